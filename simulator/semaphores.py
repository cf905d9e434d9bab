"""The simulated semaphores at run time: their counts, their vector clocks, and waits.

A semaphore is an id (handed out by `new_semaphore_ids` when a kernel's
`pl.get_global` is rewritten, see `semaphore_rewrite`) and, per kernel run, one
count per device, zero when the kernel starts. `signal`, `wait` and `read` are
the interpreter callbacks that the rewritten semaphore operations call.

Race detection: a signal publishes everything its thread did before it, and a
wait joins the clocks of all signals its semaphore received so far (as the TPU
interpreter does): like an acquire of a counter that release adds built, it is
ordered after every signal the count it saw includes.

A wait that is still unsatisfied after the timeout in force when the kernel
was lowered (`wait_timeout_s`) raises a `TimeoutError` that names the device,
block, semaphore, value and count; `timeout_in` finds it again in the runtime
error jax wraps it in.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
import time

import numpy as np
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret import shared_memory as gpu_memory

DEFAULT_WAIT_TIMEOUT_S = 60.0
# Read when a kernel is lowered; `collective_interpret_mode` sets it.
wait_timeout_s: contextvars.ContextVar[float] = contextvars.ContextVar(
    "mgpu_collective_wait_timeout_s", default=DEFAULT_WAIT_TIMEOUT_S)
# How a wait timeout's line starts in the traceback jax puts in its runtime error.
_WAIT_TIMEOUT_PREFIX = "TimeoutError: semaphore_wait at "

_next_semaphore_id = itertools.count()
_semaphore_origin: dict[int, str] = {}  # semaphore id -> where `get_global` was called.


def new_semaphore_ids(count: int, origin: str) -> int:
  """Reserves `count` consecutive semaphore ids (unique per process); returns the first.

  `origin` (where the kernel's `pl.get_global` is) names them in errors.
  """
  first_id = next(_next_semaphore_id)
  for _ in range(count - 1):
    next(_next_semaphore_id)
  for i in range(count):
    _semaphore_origin[first_id + i] = origin
  return first_id


def _describe(sem_id: int) -> str:
  return f"semaphore {sem_id} (pl.get_global at {_semaphore_origin.get(sem_id, '?')})"


def timeout_in(error: BaseException) -> TimeoutError | None:
  """The `TimeoutError` of a semaphore wait that `error` (jax's wrapper) carries, or None.

  jax turns an exception raised in a callback into a runtime error whose text
  holds the callback's traceback; a thread that fails because another one
  timed out repeats that thread's traceback, so the first of our lines is the
  wait that timed out.
  """
  for line in str(error).splitlines():
    if line.startswith(_WAIT_TIMEOUT_PREFIX):
      return TimeoutError(line.removeprefix("TimeoutError: "))
  return None


class _Semaphores:
  """The semaphores of one kernel run on all devices, with their vector clocks.

  Lives on the interpreter's shared memory object, so it is created when a
  kernel starts (all counts zero) and dropped when the kernel ends.
  """

  def __init__(self):
    self.cv = threading.Condition()
    self.counts: dict[tuple[int, int], int] = {}  # (device, semaphore id) -> count
    # (device, semaphore id) -> join of the clocks of all signals it received.
    self.clocks: dict[tuple[int, int], gpu_memory.GpuClockBundle] = {}


_semaphores_lock = threading.Lock()


def _semaphores(shared_memory) -> _Semaphores:
  with _semaphores_lock:
    state = getattr(shared_memory, "_mgpu_semaphores", None)
    if state is None:
      state = _Semaphores()
      shared_memory._mgpu_semaphores = state  # noqa: SLF001
    return state


@gpu_callbacks.fail_on_exception
def signal(*, token, mesh_location, thread, sem_id, inc, target, num_devices, where):
  """Adds `inc` to semaphore `sem_id` of device `target`."""
  del mesh_location
  target, sem_id, inc = int(target), int(sem_id), int(inc)
  if not 0 <= target < num_devices:
    raise ValueError(
        f"semaphore_signal at {where} on device {thread.device_id} targets device {target}, "
        f"but the mesh has {num_devices} devices.")
  shared_memory = gpu_callbacks._get_shared_memory()  # noqa: SLF001
  # The signal publishes everything the signalling thread did so far: bump its
  # clock so that its later accesses are not covered by this signal.
  clock = shared_memory.incr_clock(thread) if shared_memory.detect_races else None
  state = _semaphores(shared_memory)
  with state.cv:
    state.counts[target, sem_id] = state.counts.get((target, sem_id), 0) + inc
    if clock is not None:
      if (target, sem_id) in state.clocks:
        state.clocks[target, sem_id].update(clock)
      else:
        state.clocks[target, sem_id] = clock
    state.cv.notify_all()
  return token


@gpu_callbacks.fail_on_exception
def wait(*, token, mesh_location, thread, sem_id, value, decrement, timeout_s, where):
  """Blocks until this device's semaphore `sem_id` counts `value`, then takes it if `decrement`."""
  sem_id, value = int(sem_id), int(value)
  shared_memory = gpu_callbacks._get_shared_memory()  # noqa: SLF001
  state = _semaphores(shared_memory)
  key = (thread.device_id, sem_id)
  deadline = time.monotonic() + timeout_s
  while True:
    # Another thread's failure (e.g. its own timeout) ends this wait too.
    shared_memory.check_failed()
    with state.cv:
      count = state.counts.get(key, 0)
      if count >= value:
        if decrement:
          state.counts[key] = count - value
        clock = state.clocks.get(key)
        clock = clock.copy() if clock is not None else None
        break
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        # The text starts with `_WAIT_TIMEOUT_PREFIX`, which `timeout_in` looks for.
        raise TimeoutError(
            f"semaphore_wait at {where} on device {thread.device_id} "
            f"(mesh coordinates {mesh_location.device_coords}, block {thread.block_id}, "
            f"warpgroup {thread.warpgroup_id}) still waits after {timeout_s:g} s on "
            f"{_describe(sem_id)}: it wants a count >= {value}, the count is {count}. "
            "A signal is missing or the wait value is too large; if the kernel is just "
            "slow, raise collective_interpret_mode(wait_timeout_s=...).")
      state.cv.wait(min(remaining, 0.1))
  if clock is not None:
    # The wait orders the signallers' past before this thread's future.
    with shared_memory.lock:
      mine = shared_memory.clocks[thread]
      mine.update(clock)
      # Also before its TMA copies, which the interpreter checks with the
      # thread's async-proxy clock: Pallas has no GMEM proxy fence, so without
      # this no kernel could safely overwrite a peer's slot after the peer
      # signalled that it has read it. This thread's own SMEM writes stay
      # invisible to its TMA engine until `commit_smem`.
      peers = clock.generic_clock.copy()
      own = shared_memory.thread_to_vc_position(thread)
      peers.clock[own] = min(peers.clock[own], mine.async_smem_clock.clock[own])
      mine.async_smem_clock.update(peers)
  return token


@gpu_callbacks.fail_on_exception
def read(*, token, mesh_location, thread, sem_id):
  """The count of this device's semaphore `sem_id`."""
  del mesh_location
  state = _semaphores(gpu_callbacks._get_shared_memory())  # noqa: SLF001
  with state.cv:
    count = state.counts.get((thread.device_id, int(sem_id)), 0)
  return token, np.int32(count)
