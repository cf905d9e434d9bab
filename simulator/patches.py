"""The nine patches of jax 0.11.2's private GPU interpreter that `install` applies.

JAX's GPU interpret mode runs one Mosaic GPU kernel per device of a
`jax.shard_map` (XLA's CPU client runs the devices' programs on separate
threads, and the interpreter already shares one simulated memory between
them), but it has no semaphores and no peer memory. The patches add both, by
wrapping interpreter functions; each is commented where `install` makes it:

  * semaphore operations are rewritten as they are interpreted
    (`semaphore_rewrite`), and kernels that use semaphores run all their
    blocks concurrently (on a GPU a collective kernel's grid is resident at
    once, and a wait for the signals of every block of a peer deadlocks
    otherwise);
  * `plgpu.remote_ref(ref, device_id)` on a GMEM ref (a kernel input or
    output) resolves to the same buffer on the peer device, for TMA copies
    in both directions and plain loads and stores;
  * devices meet at a barrier after allocating their buffers and at the end
    of each grid step, so that race detection spans devices: a TMA write into
    a peer's buffer is checked against the peer's own accesses with the
    interpreter's vector clocks;
  * simulated threads are spread over the CPU devices (`thread_pool`), each
    device compiles their program once, and a kernel with more of them than
    XLA can run is refused.

A kernel without semaphores or peer refs is interpreted as before, except
that on several devices they start and finish each grid step together.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import callback
from jax._src import config as jax_config
from jax._src import core as jax_core
from jax._src.pallas.mosaic.interpret import thread_map
from jax._src.pallas.mosaic.interpret import utils as interpret_utils
from jax._src.pallas.mosaic_gpu import core as mosaic_gpu_core
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret
from jax._src.pallas.mosaic_gpu.interpret import shared_memory as gpu_memory

from core import interpret, jax_private
from simulator import semaphore_rewrite, thread_pool

_logger = logging.getLogger(__name__)

# Position of `device_id` in a `HostAllocationKey` as an array (see its `__iter__`).
_KEY_DEVICE_FIELD = 1

_install_lock = threading.Lock()


def check_jax_version() -> None:
  """Raises unless the installed jax is the one whose interpreter these patches extend."""
  jax_private.check_jax_version(user="simulator (it patches jax's GPU interpreter)",
                                port="the modules of simulator/")


def install() -> None:
  """Patches jax 0.11.2's GPU interpreter (idempotent; raises on other jax versions)."""
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
    # over the CPU devices, and compile each thread program once per device.
    thread_map._run_jaxpr = _run_jaxpr_compiled_once  # noqa: SLF001
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


# What the kernel being traced (in this thread) needs in functions that do not get it.
_tracing = threading.local()


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
    if semaphore_rewrite.uses_semaphores(jaxpr):
      if mesh is None:
        raise NotImplementedError(
            "Semaphores in GPU interpret mode need a `plgpu.kernel` (a mesh), "
            "not a `pallas_call` with a grid.")
      mesh = _all_blocks_concurrent(mesh)
    num_devices = jaxpr_interpret.DeviceInfo().num_devices
    if mesh is not None:
      # Warps of a `WarpMesh` are threads too, but only while their warpgroup waits.
      threads = num_devices * math.prod(mesh.cluster) * (mesh.num_threads or 1)
      thread_pool.check_intra_op_pool(threads, num_devices)
      if threads > thread_pool.max_concurrent_threads():
        raise NotImplementedError(
            f"Interpreting this kernel takes {threads} concurrent CPU threads ({num_devices} "
            f"devices x {math.prod(mesh.cluster)} blocks x {mesh.num_threads or 1} "
            f"warpgroups); at most {thread_pool.max_concurrent_threads()} run on "
            f"{jax.local_device_count('cpu')} CPU devices. Use a smaller grid or more "
            "devices (--xla_force_host_platform_device_count).")
    previous = getattr(_tracing, "num_devices", 1)
    _tracing.num_devices = num_devices
    try:
      # The kernel body was traced without mesh-axis types (as `plgpu.kernel`
      # does); re-binding its primitives under a type-checked `shard_map`
      # would fail on `lax.axis_index` (varying) meeting a constant.
      with jax_config._check_vma(False):
        return original(*args, jaxpr=jaxpr, mesh=mesh, **kwargs)
    finally:
      _tracing.num_devices = previous
  return interpret_pallas_call


class _CompiledThreadPrograms:
  """The compiled program of each simulated thread, one per (jaxpr, CPU device, avals).

  All simulated threads of a kernel start at once with the same jaxpr, and
  jax's own caches do not hold back threads that miss together: each thread
  compiled the program again, about a second of CPU each, so a 4-device ring
  of 4 blocks (48 threads) started its last threads seconds after its first.
  Here the first thread compiles and the others of the same key wait for it.
  """

  def __init__(self):
    self._lock = threading.Lock()
    # jaxpr -> {(device id, avals): [lock, compiled or None]}; an entry goes
    # with its jaxpr, which lives as long as the kernel's traced program.
    self._programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

  def get(self, jaxpr, device, consts, args):
    avals = tuple((np.shape(x), np.asarray(x).dtype) for x in jax.tree.leaves((consts, args)))
    with self._lock:
      slot = self._programs.setdefault(jaxpr, {}).setdefault(
          (device.id, avals), [threading.Lock(), None])
    with slot[0]:
      if slot[1] is None:  # Also after a failed compilation, which raised in its thread.
        slot[1] = jax.jit(_run_thread, static_argnums=(0,)).trace(
            jaxpr, consts, *args).lower().compile()
      return slot[1]


def _run_thread(jaxpr, consts, *args):
  """A simulated thread's program, returning its outputs (its final ordering token).

  jax's own `thread_map._run` returns nothing, so the caller has nothing to wait for:
  XLA's CPU client may run the program asynchronously (it did for about a third of a
  4-device ring's threads) and the call returns before the thread has run. The
  interpreter then took the thread as finished: its device went on to the end of the
  grid step, reset the per-step state, read the outputs and cleaned up the shared
  memory while the thread still ran (a semaphore short of its count, or a barrier left
  allocated, at random). Returning the token lets `_run_jaxpr_compiled_once` wait.
  """
  return jax_core.eval_jaxpr(jaxpr, consts, *args)


_compiled_thread_programs = _CompiledThreadPrograms()


def _run_jaxpr_compiled_once(jaxpr, consts, *args):
  """`thread_map._run_jaxpr`: runs a simulated thread on a CPU device with room
  for it, with the program compiled once per device (`_CompiledThreadPrograms`)."""
  with thread_pool.on_cpu_device_with_room() as device:
    outputs = _compiled_thread_programs.get(jaxpr, device, consts, args)(consts, *args)
    # Until the thread has run to its end (`_run_thread`); also raises its error here.
    jax.block_until_ready(outputs)


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


def _wrap_interpret(original):
  @functools.wraps(original)
  def interpret(self, jaxpr, token, *args):
    previous = getattr(_tracing, "device_info", None)
    _tracing.device_info = self.device_info  # For `resolve_ref`, which has no `self`.
    try:
      return original(self, semaphore_rewrite.rewrite(jaxpr), token, *args)
    finally:
      _tracing.device_info = previous
  return interpret


def _wrap_inline_mgpu(original):
  @functools.wraps(original)
  def _interpret_inline_mgpu_p(self, eqn, token, get_invals):
    op = eqn.params.get(semaphore_rewrite.OP_PARAM)
    if op is None:
      return original(self, eqn, token, get_invals)
    return semaphore_rewrite.interpret_semaphore_op(self, eqn, op, token, get_invals())
  return _interpret_inline_mgpu_p
