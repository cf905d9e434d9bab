"""One switch that runs any kernel of this repo in GPU interpret mode on CPU.

Every kernel wrapper passes `interpret_params()` as `interpret=` to
`plgpu.kernel`. It returns `None` (compile for the GPU) when a GPU is present,
and `plgpu.InterpretGPUParams` when:
  * there is no GPU in the process (automatic), or
  * the environment variable `MGPU_INTERPRET=1` is set, or
  * the call runs inside `with interpret_mode(...):`.
`MGPU_INTERPRET=0` forbids interpret mode: without a GPU, kernels then fail
to compile instead of silently running on CPU. Race detection is on inside
`interpret_mode(detect_races=True)` (what the tests use) or with
`MGPU_DETECT_RACES=1`.

The race detector orders events with vector clocks, and the interpreter gives
each TMA copy one of `tma_threads_per_device` pseudo-threads, handed out
round-robin over all devices. Two copies that share one are ordered, so a copy
that was never waited for can look completed when a later copy, which was
waited for, happened to get its pseudo-thread: with jax's default of 5 that
hides real races, depending on how the simulated threads interleave. We use
enough of them that the copies of a test-sized kernel never share one.

The choice is made when a kernel is traced, so a function already traced under
`jax.jit` keeps the mode it was traced with.

Each simulated thread (a warpgroup of a block) is an XLA execution on the CPU,
and one that waits at a barrier holds a thread of XLA's CPU intra-op pool,
which XLA sizes once, when jax starts its CPU backend: `PJRT_NPROC`, else the
CPU count. A warp-specialized kernel runs three warpgroups a block; with fewer
pool threads than that and one more, the waiting ones can take them all while
the one they wait for cannot run, and the kernel never returns (it happened
on a 2-core machine). Interpret mode warns once when the pool is that small.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import device, jax_private

INTERPRET_ENV = "MGPU_INTERPRET"
DETECT_RACES_ENV = "MGPU_DETECT_RACES"
# TMA pseudo-threads per device (see above). The ring kernel on 4 simulated
# devices issues about 140 copies per device; each one costs every vector
# clock an entry.
TMA_THREADS_PER_DEVICE = 256
# Simulated threads of a warp-specialized block (two compute warpgroups and a
# memory warpgroup), and one pool thread for the computations their callbacks run.
MIN_INTRA_OP_THREADS = 3 + 1
_POOL_THREAD_NAME = "tf_XLAEigen"
_XLA_MAX_POOL_THREADS = 256

_logger = logging.getLogger(__name__)

_forced: contextvars.ContextVar[plgpu.InterpretGPUParams | bool | None] = contextvars.ContextVar(
    "mgpu_forced_interpret", default=None)


def _env_flag(name: str) -> bool | None:
  value = os.environ.get(name)
  if value is None or value == "":
    return None
  if value.lower() in ("1", "true", "yes", "on"):
    return True
  if value.lower() in ("0", "false", "no", "off"):
    return False
  raise ValueError(f"{name}={value!r}: expected 1/true/yes/on or 0/false/no/off")


@contextlib.contextmanager
def interpret_mode(*, detect_races: bool = True,
                   tma_threads_per_device: int = TMA_THREADS_PER_DEVICE):
  """Runs every kernel of this repo traced inside the block in interpret mode.

  An exception leaving the block resets the interpreter (`reset_after_failure`);
  one caught inside it needs that call.
  """
  token = _forced.set(_params(detect_races, tma_threads_per_device))
  try:
    yield
  except BaseException:
    reset_after_failure()
    raise
  finally:
    _forced.reset(token)


def reset_after_failure() -> None:
  """Makes interpret mode usable again after a kernel failed in it.

  Clears the interpreter's shared state (as jax asks one to) and jax's tokens
  of ordered effects: the interpreter orders kernels with an ordered
  `io_callback`, whose token now carries the error and would fail every later
  kernel in this thread.
  """
  jax_private.reset_gpu_interpreter()


@contextlib.contextmanager
def interpret_disabled():
  """Traces kernels for the GPU inside the block, GPU or not (for lowering only)."""
  token = _forced.set(False)
  try:
    yield
  finally:
    _forced.reset(token)


def interpret_params() -> plgpu.InterpretGPUParams | None:
  """The `interpret=` argument for `plgpu.kernel` under the current settings."""
  forced = _forced.get()
  if forced is False:
    return None
  if forced is not None:
    return forced
  wanted = _env_flag(INTERPRET_ENV)
  if wanted is None:
    wanted = not device.has_gpu()
  if not wanted:
    return None
  return _params(bool(_env_flag(DETECT_RACES_ENV)), TMA_THREADS_PER_DEVICE)


@functools.cache
def _counted_intra_op_threads() -> int:
  """Threads of XLA's CPU intra-op pool, counted by name (Linux; 0 elsewhere)."""
  try:
    tasks = os.listdir("/proc/self/task")
  except OSError:
    return 0
  count = 0
  for task in tasks:
    try:
      with open(f"/proc/self/task/{task}/comm") as f:
        count += f.read().strip() == _POOL_THREAD_NAME
    except OSError:
      continue
  return count


def intra_op_pool_size() -> int:
  """The number of threads of XLA's CPU intra-op pool (starts the CPU backend)."""
  jax.devices("cpu")  # Starts the backend, whose pool starts all its threads.
  counted = _counted_intra_op_threads()
  if counted:
    return counted
  _counted_intra_op_threads.cache_clear()
  # What XLA computes (xla/pjrt/cpu/cpu_client.cc), where threads have no names.
  requested = os.environ.get("PJRT_NPROC") or os.environ.get("NPROC") or os.cpu_count() or 1
  return min(max(int(requested), jax.local_device_count("cpu")), _XLA_MAX_POOL_THREADS)


@functools.cache
def _warn_if_intra_op_pool_is_small() -> None:
  """Warns, once a process, when a warp-specialized kernel could deadlock the
  interpreter (see the module docstring)."""
  pool = intra_op_pool_size()
  if pool < MIN_INTRA_OP_THREADS:
    _logger.warning(
        "Interpret mode: XLA's CPU intra-op pool has %d threads, fewer than the %d a "
        "warp-specialized kernel's simulated warpgroups may hold while they wait, so a "
        "kernel may never return. Set the environment variable PJRT_NPROC=16 before jax "
        "starts its CPU backend.", pool, MIN_INTRA_OP_THREADS)


def _params(detect_races: bool, tma_threads_per_device: int) -> plgpu.InterpretGPUParams:
  _warn_if_intra_op_pool_is_small()
  return plgpu.InterpretGPUParams(detect_races=detect_races,
                                  num_tma_threads_per_device=tma_threads_per_device)


_peers_simulated = False


def mark_peers_simulated() -> None:
  """Called by the simulator (`simulator.install`) once it has extended the interpreter."""
  global _peers_simulated
  _peers_simulated = True


def can_interpret_collectives() -> bool:
  """Whether interpret mode can run semaphores and `plgpu.remote_ref` across devices.

  Only after the simulator is installed (`simulator.collective_interpret_mode()`);
  plain jax 0.11.2 cannot.
  """
  return _peers_simulated


def is_interpreting() -> bool:
  """Whether kernels traced now would run in interpret mode."""
  return interpret_params() is not None


@contextlib.contextmanager
def race_log():
  """Keeps the race-detection state of every kernel interpreted inside the block.

  The interpreter replaces its state when the next kernel starts, so
  `races_found()` answers for the last kernel only; a function that
  launches several (a split-K sum, a `lax.map` over a batch) needs this.
  Yields a list that gets each kernel's state as it starts; a state's
  `races_found` is final once its kernel is done.
  """
  with jax_private.recorded_race_states() as states:
    yield states


def races_found() -> bool:
  """Whether the race detector flagged a race in the last interpreted kernel."""
  return jax_private.last_kernel_races_found()
