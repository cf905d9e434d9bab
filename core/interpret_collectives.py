"""Multi-device GPU interpret mode: semaphores and peer memory on simulated devices.

JAX 0.11.2's GPU interpret mode runs one Mosaic GPU kernel per device of a
`jax.shard_map` (XLA's CPU client runs the devices' programs on separate
threads, and the interpreter already shares one simulated memory between
them), but it has no semaphores and no peer memory. This module adds both:

  * `pl.get_global(plgpu.SemaphoreType.REGULAR)` (also arrays of semaphores,
    indexed with `.at[i]`): one semaphore per device, zero when the kernel
    starts. Every block of the kernel sees the same semaphore, as on a GPU.
  * `pl.semaphore_signal(sem, inc, device_id=...)` (and the `plgpu.` variant):
    adds `inc` to the semaphore on `device_id`, or on this device if omitted.
  * `pl.semaphore_wait(sem, value, decrement=...)`: blocks until the count is
    at least `value`, then subtracts `value` if `decrement` (the default). A
    wait that is still unsatisfied after `wait_timeout_s` seconds fails with
    a `TimeoutError` naming the device, block, semaphore, value and count
    (see `collective_interpret_mode` for where it is raised).
  * `pl.semaphore_read(sem)`.
  * `plgpu.remote_ref(ref, device_id)` on a GMEM ref (a kernel input or
    output): TMA copies into it (`copy_smem_to_gmem`) and out of it
    (`copy_gmem_to_smem`), and plain loads and stores, go to the same buffer
    on the peer device.

`device_id`s are mesh coordinates as in `pl.semaphore_signal`: an integer on a
1-D mesh, a tuple of coordinates or a `{axis_name: index}` dict on an N-D mesh
(`DeviceIdType.LOGICAL` ids work too). Tested on 1-D meshes.

Race detection spans devices: a TMA write into a peer's buffer is checked
against the peer's own reads and writes of that buffer with the interpreter's
vector clocks, and a semaphore signal -> wait pair orders the signaller before
the waiter. A wait joins the clocks of all signals its semaphore received so
far (as the TPU interpreter does): like an acquire of a counter that release
adds built, it is ordered after every signal the count it saw includes. Races
are found in the interleaving that ran: a protocol that is only racy when one
device runs ahead shows up when it does (more often on a busy CPU). They are
reported where the interpreter reports them, so `core.interpret.races_found()`
sees them.

Kernels that use semaphores run all their blocks concurrently (on a GPU a
collective kernel's grid is resident at once, and a wait for the signals of
every block of a peer deadlocks otherwise); other kernels keep the
interpreter's one-block-at-a-time grid loop. Every simulated thread is a CPU
thread, so keep grids small: devices x blocks x `num_threads`.

A simulated thread that waits (a semaphore, a barrier) blocks the CPU thread
its callback runs on, and XLA runs a thread's program partly on its intra-op
thread pool, which has only max(CPUs, CPU devices) threads by default: with
more simulated threads than that, the waiters can hold every pool thread while
the thread they wait for needs one (a deadlock that shows up as a wait
timeout). Importing this module before jax starts its CPU backend therefore
sizes that pool (`PJRT_NPROC`, see `reserve_intra_op_threads`), and a kernel
that could exhaust the pool it got is refused with an error that says so.

Usage: nothing changes in the kernels, which pass `interpret=interpret_params()`
as before. Tests trace them inside `collective_interpret_mode()`:

    with interpret_collectives.collective_interpret_mode(wait_timeout_s=60):
      out = jax.jit(jax.shard_map(kernel_fn, mesh=mesh, ...))(x)
    assert not interpret.races_found()

The block waits for the kernels it started when it ends, so a wait timeout is
raised by the `with` statement at the latest, as a `TimeoutError`.

Settings are read when a kernel is lowered (like `interpret_mode`), so a
function already compiled keeps the timeout it was compiled with.

This extends private interpreter internals of jax 0.11.2 (it patches them, see
`install`), so it refuses any other jax version.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import dataclasses
import functools
import itertools
import logging
import math
import os
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import callback, source_info_util, xla_bridge
from jax._src import core as jax_core
from jax._src.pallas import primitives as pallas_primitives
from jax._src.pallas.mosaic.interpret import thread_map
from jax._src.pallas.mosaic.interpret import utils as interpret_utils
from jax._src.pallas.mosaic_gpu import core as mosaic_gpu_core
from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret
from jax._src.pallas.mosaic_gpu.interpret import shared_memory as gpu_memory
from jax._src.state import indexing

from core import interpret

SUPPORTED_JAX_VERSION = "0.11.2"
DEFAULT_WAIT_TIMEOUT_S = 60.0
# How a wait timeout's line starts in the traceback jax puts in its runtime error.
_WAIT_TIMEOUT_PREFIX = "TimeoutError: semaphore_wait at "

_logger = logging.getLogger(__name__)

_wait_timeout_s: contextvars.ContextVar[float] = contextvars.ContextVar(
    "mgpu_collective_wait_timeout_s", default=DEFAULT_WAIT_TIMEOUT_S)

_SIGNAL_PRIMITIVES = (pallas_primitives.semaphore_signal_p, gpu_primitives.semaphore_signal_p)
_WAIT_PRIMITIVES = (pallas_primitives.semaphore_wait_p, gpu_primitives.semaphore_wait_p)
_SEMAPHORE_PRIMITIVES = (pallas_primitives.get_global_p, pallas_primitives.semaphore_read_p,
                         *_SIGNAL_PRIMITIVES, *_WAIT_PRIMITIVES)

# Position of `device_id` in a `HostAllocationKey` as an array (see its `__iter__`).
_KEY_DEVICE_FIELD = 1


def check_jax_version() -> None:
  """Raises unless the installed jax is the one whose interpreter this module extends."""
  if jax.__version__ != SUPPORTED_JAX_VERSION:
    raise NotImplementedError(
        f"core.interpret_collectives extends the private GPU interpreter of jax "
        f"{SUPPORTED_JAX_VERSION}; the installed jax is {jax.__version__}. Port the "
        f"patches in core/interpret_collectives.py to it (or pin jax=={SUPPORTED_JAX_VERSION}).")


@contextlib.contextmanager
def collective_interpret_mode(*, detect_races: bool = True,
                              wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
                              tma_threads_per_device: int = interpret.TMA_THREADS_PER_DEVICE):
  """Interprets the kernels traced inside the block, with semaphores and peer memory.

  Installs the extension (see `install`), enters `interpret.interpret_mode`, and
  makes a `semaphore_wait` that is still unsatisfied after `wait_timeout_s`
  seconds fail instead of hanging. A kernel that issues more TMA copies than
  `tma_threads_per_device` x devices logs a warning (see `core.interpret`:
  the race detector may then miss a copy nobody waited for). An exception
  leaving the block resets the interpreter (`interpret.reset_after_failure`);
  one caught inside it needs that call.

  The timeout is raised inside a callback of the running kernel, so jax
  reports it as a `jax.errors.JaxRuntimeError` wherever the kernel's outputs
  are first waited for, which may be after the block. The block therefore
  waits for every kernel it started when it ends (`jax.effects_barrier`) and
  raises a wait timeout that leaves it as a `TimeoutError` (chained from jax's
  error). One caught inside the block is still jax's error.
  """
  if not wait_timeout_s > 0:
    raise ValueError(f"wait_timeout_s must be positive, got {wait_timeout_s=}")
  install()
  token = _wait_timeout_s.set(float(wait_timeout_s))
  try:
    with interpret.interpret_mode(detect_races=detect_races,
                                  tma_threads_per_device=tma_threads_per_device):
      try:
        yield
        # Dispatch is asynchronous: a kernel started in the block may still run.
        jax.effects_barrier()
      except jax.errors.JaxRuntimeError as e:
        timeout = _wait_timeout_error(e)
        if timeout is None:
          raise
        raise timeout from e
  finally:
    _wait_timeout_s.reset(token)


def _wait_timeout_error(error: BaseException) -> TimeoutError | None:
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


# --- XLA's CPU thread pools -----------------------------------------------------------

# Threads XLA's CPU client gives its intra-op pool and its dispatch pool when
# this module sets `PJRT_NPROC`; XLA caps the intra-op pool at 256.
INTRA_OP_THREADS = 128
# Pool threads kept free of simulated threads: the per-device programs that
# wait for their simulated threads (one per device, on top of the simulated
# threads) and the small computations callbacks run.
_SPARE_POOL_THREADS = 4
_POOL_THREAD_NAME = "tf_XLAEigen"


def reserve_intra_op_threads(num_threads: int = INTRA_OP_THREADS) -> bool:
  """Sizes XLA's CPU thread pools for interpret mode, if jax has no backend yet.

  XLA's CPU client sizes its intra-op pool, once, at max(`PJRT_NPROC` (or
  the CPU count), CPU devices) threads. Every simulated thread blocked in a
  wait may hold one of them (XLA continues a program's thunks on the pool
  thread that finished their inputs), so with fewer pool threads than
  simulated threads the waiters can take them all while the thread they wait
  for has thunks queued on the pool: nobody runs. Called when this module is
  imported; does nothing where `PJRT_NPROC` is set or a backend exists.
  Returns whether it set `PJRT_NPROC`.
  """
  if "PJRT_NPROC" in os.environ or xla_bridge.backends_are_initialized():
    return False
  os.environ["PJRT_NPROC"] = str(num_threads)
  return True


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
  """The number of threads of XLA's CPU intra-op pool (the CPU backend must exist)."""
  jax.devices("cpu")  # Starts the backend, whose pool starts all its threads.
  counted = _counted_intra_op_threads()
  if counted:
    return counted
  _counted_intra_op_threads.cache_clear()
  # What XLA computes (xla/pjrt/cpu/cpu_client.cc), where threads have no names.
  requested = os.environ.get("PJRT_NPROC") or os.environ.get("NPROC") or os.cpu_count() or 1
  return min(max(int(requested), jax.local_device_count("cpu")), 256)


reserve_intra_op_threads()


# --- Installation ---------------------------------------------------------------------

_install_lock = threading.Lock()


def install() -> None:
  """Patches jax 0.11.2's GPU interpreter (idempotent; raises on other jax versions).

  Each patch is commented where it is made. A kernel without semaphores or
  peer refs is interpreted as before, except that on several devices they
  start and finish each grid step together, and that a process with many
  simulated threads runs them on several CPU devices.
  """
  check_jax_version()
  with _install_lock:
    if interpret.can_interpret_collectives():
      return
    # The lowering of `pallas_call` looks this function up on the module each
    # time, so wrapping it lets us change the mesh of semaphore kernels (all
    # blocks concurrent) and mark the trace as multi-device.
    gpu_interpret.interpret_pallas_call = _wrap_interpret_pallas_call(
        gpu_interpret.interpret_pallas_call)
    # Called (at trace time) right after the kernel's buffers are allocated;
    # we add a barrier across devices there, so no device writes into a peer's
    # buffer before the peer has allocated it.
    gpu_callbacks.call_update_clocks_for_device_barrier = _wrap_device_barrier(
        gpu_callbacks.call_update_clocks_for_device_barrier)
    # Called when a device finishes a grid step; it resets the clocks and
    # pending copies of *all* devices, assuming that nothing else runs. Other
    # devices do run, so a device's reset erased the ordering its peers had
    # just established (false races). We make it a step of all devices: all
    # arrive, one resets, all go on.
    gpu_callbacks.cluster_finished = _all_devices_cluster_finished
    # `n` arrives as a jax Array, and `wait_smem_to_gmem` compares it while
    # holding the shared-memory lock: a jax computation that, with many
    # simulated threads blocked on that lock, never gets to run (deadlock).
    gpu_callbacks.wait_smem_to_gmem = _wrap_wait_smem_to_gmem(gpu_callbacks.wait_smem_to_gmem)
    # TMA copies get pseudo-threads round-robin, and copies that share one
    # are ordered (see `core.interpret`); say when a kernel runs out of them.
    gpu_memory.GPUSharedMemory.get_next_tma_thread_id = _warn_when_tma_threads_run_out(
        gpu_memory.GPUSharedMemory.get_next_tma_thread_id)
    # Each simulated thread is an XLA execution, on the default CPU device; XLA
    # runs at most 32 at once per device and queues the rest, so a kernel
    # whose blocks all run concurrently deadlocks beyond that. Spread them
    # over the CPU devices.
    thread_map._run_jaxpr = _spread_over_cpu_devices(thread_map._run_jaxpr)  # noqa: SLF001
    # The interpreter has no case for semaphore primitives (they fall through
    # to `bind`, which fails). We rewrite their equations into `inline_mgpu`
    # equations tagged as ours: that case receives the token, which orders
    # our callbacks with the interpreter's own.
    jaxpr_interpret.JaxprInterpreter.interpret = _wrap_interpret(
        jaxpr_interpret.JaxprInterpreter.interpret)
    jaxpr_interpret.JaxprInterpreter._interpret_inline_mgpu_p = _wrap_inline_mgpu(  # noqa: SLF001
        jaxpr_interpret.JaxprInterpreter._interpret_inline_mgpu_p)  # noqa: SLF001
    # Every access of a ref (get, swap, both TMA copies) goes through
    # `resolve_ref` at trace time, so it is the one place to turn a
    # `PeerMemRef` transform into the peer's allocation key.
    jaxpr_interpret.resolve_ref = _wrap_resolve_ref(jaxpr_interpret.resolve_ref)
    interpret.mark_peers_simulated()


# --- Trace-time patches ---------------------------------------------------------------

# What the kernel being traced (in this thread) needs in functions that do not get it.
_tracing = threading.local()


def _uses_semaphores(jaxpr: jax_core.Jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive in _SEMAPHORE_PRIMITIVES:
      return True
    if any(_uses_semaphores(sub) for sub in jax_core.jaxprs_in_params(eqn.params)):
      return True
  return False


def _all_blocks_concurrent(mesh: mosaic_gpu_core.Mesh) -> mosaic_gpu_core.Mesh:
  """The same kernel with its grid folded into the cluster, whose blocks run concurrently.

  `axis_index` of a grid axis then reads the block's cluster coordinate, which
  is the same number.
  """
  folded = copy.copy(mesh)
  # Not `dataclasses.replace`: `Mesh.__post_init__` limits clusters to 3-D,
  # which the interpreter itself does not need.
  for name, value in (("grid", ()), ("grid_names", ()),
                      ("cluster", (*mesh.grid, *mesh.cluster)),
                      ("cluster_names", (*mesh.grid_names, *mesh.cluster_names))):
    object.__setattr__(folded, name, tuple(value))
  return folded


def _wrap_interpret_pallas_call(original):
  @functools.wraps(original)
  def interpret_pallas_call(*args, jaxpr, mesh, **kwargs):
    if _uses_semaphores(jaxpr):
      if mesh is None:
        raise NotImplementedError(
            "Semaphores in GPU interpret mode need a `plgpu.kernel` (a mesh), "
            "not a `pallas_call` with a grid.")
      mesh = _all_blocks_concurrent(mesh)
    num_devices = jaxpr_interpret.DeviceInfo().num_devices
    if mesh is not None:
      # Warps of a `WarpMesh` are threads too, but only while their warpgroup waits.
      threads = num_devices * math.prod(mesh.cluster) * (mesh.num_threads or 1)
      _check_intra_op_pool(threads, num_devices)
      if threads > _max_concurrent_threads():
        raise NotImplementedError(
            f"Interpreting this kernel takes {threads} concurrent CPU threads ({num_devices} "
            f"devices x {math.prod(mesh.cluster)} blocks x {mesh.num_threads or 1} "
            f"warpgroups); at most {_max_concurrent_threads()} run on "
            f"{jax.local_device_count('cpu')} CPU devices. Use a smaller grid or more "
            "devices (--xla_force_host_platform_device_count).")
    previous = getattr(_tracing, "num_devices", 1)
    _tracing.num_devices = num_devices
    try:
      return original(*args, jaxpr=jaxpr, mesh=mesh, **kwargs)
    finally:
      _tracing.num_devices = previous
  return interpret_pallas_call


def _check_intra_op_pool(threads: int, num_devices: int) -> None:
  """Raises unless XLA's intra-op pool has a thread left when `threads` simulated threads wait."""
  pool = intra_op_pool_size()
  needed = threads + num_devices + _SPARE_POOL_THREADS
  if needed > pool:
    raise NotImplementedError(
        f"Interpreting this kernel takes {threads} concurrent simulated threads, each of which "
        f"may block a thread of XLA's CPU intra-op pool while it waits, but that pool has only "
        f"{pool} threads (it needs {needed}), so the kernel could deadlock. Set the environment "
        f"variable PJRT_NPROC={max(needed, INTRA_OP_THREADS)} before jax starts its CPU "
        "backend (importing core.interpret_collectives first does that), or use a smaller "
        "grid.")


# XLA's CPU client runs at most 32 executions at once per device; we keep
# some of them free for the small computations the interpreter's callbacks
# run (jnp operations on their arguments).
_THREADS_PER_CPU_DEVICE = 24
_threads_on_device: collections.Counter = collections.Counter()
_threads_lock = threading.Lock()


def _max_concurrent_threads() -> int:
  return _THREADS_PER_CPU_DEVICE * jax.local_device_count("cpu")


def _spread_over_cpu_devices(original):
  @functools.wraps(original)
  def _run_jaxpr(jaxpr, consts, *args):
    devices = jax.local_devices(backend="cpu")
    with _threads_lock:
      # The first device as long as it has room: another device means
      # compiling the thread's jaxpr again.
      device = devices[0]
      if _threads_on_device[device.id] >= _THREADS_PER_CPU_DEVICE:
        device = min(devices, key=lambda d: _threads_on_device[d.id])
      _threads_on_device[device.id] += 1
    try:
      with jax.default_device(device):
        return original(jaxpr, consts, *args)
    finally:
      with _threads_lock:
        _threads_on_device[device.id] -= 1
  return _run_jaxpr


def _wrap_device_barrier(original):
  @functools.wraps(original)
  def call_update_clocks_for_device_barrier(token, device):
    if getattr(_tracing, "num_devices", 1) > 1:
      token = callback.io_callback(_all_devices_barrier, gpu_callbacks.TOKEN_SHAPE_DTYPE,
                                   token=token, device=device)
    return original(token, device)
  return call_update_clocks_for_device_barrier


@gpu_callbacks.fail_on_exception
def _all_devices_barrier(token, device):
  del device  # Named so that a failure is attributed to it.
  # A barrier of all devices the interpreter creates per kernel and leaves
  # unused; a failure on any device aborts it.
  gpu_callbacks._get_shared_memory().barrier.wait()  # noqa: SLF001
  return token


@gpu_callbacks.fail_on_exception
def _all_devices_cluster_finished(*, token):
  shared_memory = gpu_callbacks._get_shared_memory()  # noqa: SLF001
  # Every device runs the same grid, so all of them get here once per step.
  if shared_memory.barrier.wait() == 0:
    shared_memory.reset_per_cluster_state()
  shared_memory.barrier.wait()  # Nobody starts the next step before the reset.
  return token


def _wrap_wait_smem_to_gmem(original):
  @functools.wraps(original)
  def wait_smem_to_gmem(*, n, wait_read_only, **kwargs):
    return original(n=int(n), wait_read_only=bool(wait_read_only), **kwargs)
  return wait_smem_to_gmem


def _warn_when_tma_threads_run_out(original):
  @functools.wraps(original)
  def get_next_tma_thread_id(self):
    tma_thread = original(self)
    offset = tma_thread - len(self.all_concurrent_threads)
    if offset == self.num_tma_threads - 1:
      self._mgpu_tma_threads_used = True  # The next copy shares a pseudo-thread.
    elif (offset == 0 and getattr(self, "_mgpu_tma_threads_used", False)
          and self.detect_races and not getattr(self, "_mgpu_warned_tma", False)):
      self._mgpu_warned_tma = True  # Once per kernel run.
      _logger.warning(
          "A kernel issued more than %d TMA copies in one grid step, the interpreter's TMA "
          "pseudo-threads (tma_threads_per_device x devices): copies now share them, so the "
          "race detector may miss a copy that was never waited for. Raise "
          "tma_threads_per_device.", self.num_tma_threads)
    return tma_thread
  return get_next_tma_thread_id


def _wrap_resolve_ref(original):
  @functools.wraps(original)
  def resolve_ref(aval, allocation_key_as_array, transforms):
    key, transforms = original(aval, allocation_key_as_array, transforms)
    peers = [t for t in transforms if isinstance(t, mosaic_gpu_core.PeerMemRef)]
    if not peers:
      return key, transforms
    if len(peers) > 1:
      raise NotImplementedError(f"A ref with two `remote_ref`s: {transforms}")
    if not gpu_callbacks.is_gmem_memory_space(getattr(aval, "memory_space", None)):
      raise NotImplementedError(
          f"`remote_ref` of a {aval.memory_space} ref: only GMEM refs have a peer copy.")
    # The interpreter's own `DeviceInfo`: a fresh one would call `axis_index`
    # inside the jaxprs that `thread_map` runs outside of `shard_map`.
    device_info = _tracing.device_info
    peer = interpret_utils._device_id_to_logical(  # noqa: SLF001
        peers[0].device_id, peers[0].device_id_type,
        device_info.axis_sizes, device_info.axis_indices)
    # Every device allocates the kernel's GMEM buffers in the same order, so
    # the peer's copy has the same key except for its device.
    key = jnp.asarray(key).at[_KEY_DEVICE_FIELD].set(jnp.asarray(peer, key.dtype))
    return key, tuple(t for t in transforms if t is not peers[0])
  return resolve_ref


# Semaphore equations are rewritten into `inline_mgpu` equations carrying this
# parameter (a `_SemaphoreOp`); everything else about them is kept.
_OP_PARAM = "mgpu_collective_op"


@dataclasses.dataclass(frozen=True)
class _SemaphoreOp:
  kind: str  # "get_global", "signal", "wait" or "read".
  original_params: dict
  # For "get_global": the id of its first semaphore (ids are unique per process).
  first_id: int = 0

  def __hash__(self):
    return hash((self.kind, self.first_id, id(self.original_params)))


_next_semaphore_id = itertools.count()
_semaphore_origin: dict[int, str] = {}  # semaphore id -> where `get_global` was called.
_rewritten: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_rewrite_lock = threading.Lock()


def _rewrite(jaxpr: jax_core.Jaxpr) -> jax_core.Jaxpr:
  """`jaxpr` with its semaphore equations turned into tagged `inline_mgpu` ones.

  Cached, so that every thread (which all interpret the same jaxpr object)
  sees the same semaphore ids.
  """
  if not any(eqn.primitive in _SEMAPHORE_PRIMITIVES for eqn in jaxpr.eqns):
    return jaxpr
  with _rewrite_lock:
    if (done := _rewritten.get(jaxpr)) is not None:
      return done
    eqns = []
    for eqn in jaxpr.eqns:
      if eqn.primitive not in _SEMAPHORE_PRIMITIVES:
        eqns.append(eqn)
        continue
      if eqn.primitive is pallas_primitives.get_global_p:
        what = eqn.params["what"]
        size = int(np.prod(what.shape))
        first_id = next(_next_semaphore_id)
        for _ in range(size - 1):
          next(_next_semaphore_id)
        for i in range(size):
          _semaphore_origin[first_id + i] = source_info_util.summarize(eqn.source_info)
        op = _SemaphoreOp("get_global", eqn.params, first_id)
      elif eqn.primitive in _SIGNAL_PRIMITIVES:
        op = _SemaphoreOp("signal", eqn.params)
      elif eqn.primitive in _WAIT_PRIMITIVES:
        op = _SemaphoreOp("wait", eqn.params)
      else:
        op = _SemaphoreOp("read", eqn.params)
      eqns.append(eqn.replace(primitive=gpu_primitives.inline_mgpu_p, params={_OP_PARAM: op}))
    done = jaxpr.replace(eqns=eqns)
    _rewritten[jaxpr] = done
    return done


def _wrap_interpret(original):
  @functools.wraps(original)
  def interpret(self, jaxpr, token, *args):
    previous = getattr(_tracing, "device_info", None)
    _tracing.device_info = self.device_info  # For `resolve_ref`, which has no `self`.
    try:
      return original(self, _rewrite(jaxpr), token, *args)
    finally:
      _tracing.device_info = previous
  return interpret


def _wrap_inline_mgpu(original):
  @functools.wraps(original)
  def _interpret_inline_mgpu_p(self, eqn, token, get_invals):
    op = eqn.params.get(_OP_PARAM)
    if op is None:
      return original(self, eqn, token, get_invals)
    return _interpret_semaphore_op(self, eqn, op, token, get_invals())
  return _interpret_inline_mgpu_p


def _select_semaphore(ids, transforms):
  """The id of the one semaphore that `ids` (a semaphore array) `transforms` select."""
  for transform in transforms:
    if not isinstance(transform, indexing.NDIndexer):
      raise NotImplementedError(f"Unsupported transform of a semaphore ref: {transform}")
    axis = 0
    for index in transform.indices:
      if isinstance(index, indexing.Slice):
        if index.stride != 1:
          raise NotImplementedError(f"Strided slice of a semaphore array: {transform}")
        ids = lax.dynamic_slice_in_dim(ids, index.start, index.size, axis)
        axis += 1
      else:
        ids = jnp.take(ids, jnp.asarray(index), axis=axis)
  if ids.size != 1:
    raise ValueError(f"A semaphore operation needs a single semaphore, got shape {ids.shape}")
  return ids.reshape(())


def _interpret_semaphore_op(self, eqn, op: _SemaphoreOp, token, invals):
  where = source_info_util.summarize(eqn.source_info)
  if op.kind == "get_global":
    what = op.original_params["what"]
    ids = jnp.arange(int(np.prod(what.shape)), dtype=jnp.int32) + op.first_id
    return token, [ids.reshape(what.shape)]
  common = dict(token=token, mesh_location=self.mesh_location, thread=self.thread)
  args_tree = op.original_params["args_tree"]
  if op.kind == "signal":
    sem, transforms, inc, device_id, core_index = jax.tree.unflatten(args_tree, invals)
    if core_index is not None:
      raise NotImplementedError("Mosaic GPU has no cores; `core_index` must be None.")
    if device_id is None:
      target = self.device_info.device_id
    else:
      target = interpret_utils._device_id_to_logical(  # noqa: SLF001
          device_id, op.original_params["device_id_type"],
          self.device_info.axis_sizes, self.device_info.axis_indices)
    token = callback.io_callback(
        functools.partial(_signal, where=where), gpu_callbacks.TOKEN_SHAPE_DTYPE,
        sem_id=_select_semaphore(sem, transforms), inc=jnp.asarray(inc, jnp.int32),
        target=jnp.asarray(target, jnp.int32), num_devices=self.device_info.num_devices,
        **common)
    return token, []
  if op.kind == "wait":
    sem, transforms, value, decrement = jax.tree.unflatten(args_tree, invals)
    if isinstance(decrement, jax_core.Tracer):
      raise NotImplementedError("`decrement` of `semaphore_wait` must be a Python bool.")
    token = callback.io_callback(
        functools.partial(_wait, where=where, decrement=bool(decrement),
                          timeout_s=_wait_timeout_s.get()),
        gpu_callbacks.TOKEN_SHAPE_DTYPE,
        sem_id=_select_semaphore(sem, transforms), value=jnp.asarray(value, jnp.int32),
        **common)
    return token, []
  sem, transforms = jax.tree.unflatten(args_tree, invals)
  token, count = callback.io_callback(
      _read, (gpu_callbacks.TOKEN_SHAPE_DTYPE, jax.ShapeDtypeStruct((), jnp.int32)),
      sem_id=_select_semaphore(sem, transforms), **common)
  return token, [count]


# --- Run-time semaphores --------------------------------------------------------------


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


def _describe(sem_id: int) -> str:
  return f"semaphore {sem_id} (pl.get_global at {_semaphore_origin.get(sem_id, '?')})"


@gpu_callbacks.fail_on_exception
def _signal(*, token, mesh_location, thread, sem_id, inc, target, num_devices, where):
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
def _wait(*, token, mesh_location, thread, sem_id, value, decrement, timeout_s, where):
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
        # The text starts with `_WAIT_TIMEOUT_PREFIX`, which `_wait_timeout_error` looks for.
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
def _read(*, token, mesh_location, thread, sem_id):
  del mesh_location
  state = _semaphores(gpu_callbacks._get_shared_memory())  # noqa: SLF001
  with state.cv:
    count = state.counts.get((thread.device_id, int(sem_id)), 0)
  return token, np.int32(count)
