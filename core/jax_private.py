"""The one door to jax's private APIs for everything outside `simulator/`.

jax 0.11.2 has no public way to do what the functions below do, so they reach
into its private modules (`jax._src`, and `jax.experimental.mosaic.gpu.core`,
which jax does not document either). Kernels, wrappers, core's helpers and
tools call these functions and import only public jax themselves, so a jax
upgrade has one file to port.

Each function first checks that the installed jax is `PINNED_JAX_VERSION` and
otherwise raises `NotImplementedError` naming both versions: a jax upgrade
fails here, with a message, and not deep inside jax. The private modules are
imported after that check, inside the functions, so importing this module
touches nothing private and works under any jax.

The simulator (`simulator/`, test support) patches jax's GPU interpreter and
imports its private modules itself, checking the same version.
"""

from __future__ import annotations

import contextlib

import jax

PINNED_JAX_VERSION = "0.11.2"


def check_jax_version(*, user: str = "core.jax_private",
                      port: str = "core/jax_private.py") -> None:
  """Raises NotImplementedError unless the installed jax is the pinned one.

  Args:
    user: who relies on jax's private APIs, for the message.
    port: the file to port to another jax version, for the message.
  """
  if jax.__version__ != PINNED_JAX_VERSION:
    raise NotImplementedError(
        f"{user} relies on private APIs of jax {PINNED_JAX_VERSION}; the installed jax is "
        f"{jax.__version__}. Port {port} to it (or pin jax=={PINNED_JAX_VERSION}).")


# --- GPU interpret mode ---------------------------------------------------------------


def reset_gpu_interpreter() -> None:
  """Clears the GPU interpreter's shared state and jax's tokens of ordered effects.

  The interpreter orders kernels with an ordered `io_callback`; after a kernel
  failed, its token carries the error and would fail every later kernel in
  this thread, so jax's runtime tokens go too.
  """
  check_jax_version()
  from jax._src import dispatch
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

  interpret_pallas_call.reset_gpu_interpret_mode_state()
  dispatch.runtime_tokens.clear()


def last_kernel_races_found() -> bool:
  """Whether the GPU interpreter's race detector flagged a race in the last kernel."""
  check_jax_version()
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  # A module global, replaced at the start of every kernel that runs with
  # `detect_races=True`; there is no public accessor.
  races = gpu_callbacks._races  # noqa: SLF001
  return races is not None and races.races_found


@contextlib.contextmanager
def recorded_race_states():
  """Yields a list that gets the race-detection state of each kernel started in the block.

  The interpreter creates one `GPURaceDetectionState` per kernel run; the
  block swaps in a subclass that records each instance as it is created.
  """
  check_jax_version()
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  states = []
  original = gpu_callbacks.GPURaceDetectionState

  class _RecordedState(original):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      states.append(self)

  gpu_callbacks.GPURaceDetectionState = _RecordedState
  try:
    yield states
  finally:
    gpu_callbacks.GPURaceDetectionState = original


# --- Mosaic GPU -----------------------------------------------------------------------


def mosaic_gpu_pallas_call(*args, **kwargs):
  """Mosaic GPU's own `pallas_call` (`jax._src.pallas.mosaic_gpu.pallas_call`).

  The public `pl.pallas_call` has no Mosaic GPU lowering for
  `plgpu.CompilerParams` in jax 0.11.2; this entry point builds the
  `plgpu.kernel` + `emit_pipeline` structure itself. Same arguments.
  """
  check_jax_version()
  from jax._src.pallas.mosaic_gpu.pallas_call import pallas_call

  return pallas_call(*args, **kwargs)


def nvshmem_available() -> bool:
  """Whether Mosaic GPU would reach peer GPUs through NVSHMEM in this process."""
  check_jax_version()
  from jax.experimental.mosaic.gpu import core as mgpu_core

  return mgpu_core.is_nvshmem_available()


def artificial_shared_memory_limit(limit_bytes: int):
  """A context manager under which Mosaic GPU refuses kernels above `limit_bytes` of SMEM.

  Its error names the bytes the kernel needs (`smem_bytes=`), which is how a
  test reads Mosaic's own allocation.
  """
  check_jax_version()
  from jax.experimental.mosaic.gpu import core as mgpu_core

  return mgpu_core.artificial_shared_memory_limit(limit_bytes)


_boxed_copies_installed = False


def copy_one_segment_tiles_as_boxes() -> None:
  """Makes Mosaic GPU copy tiles one swizzle segment wide as plain 2D TMA boxes.

  Mosaic GPU describes every TMA copy of a tiled SMEM ref by a descriptor
  over the GMEM array tiled like the SMEM tile, in (8, segment) tiles
  (`TileTransform` in `launch_context.py`), and refuses an array whose last
  two dimensions are not multiples of them. Where the SMEM tile is exactly
  one segment wide (a (rows, 64) float16 tile under a 128-byte swizzle),
  its tiled layout is byte for byte the swizzled (rows, 64) box that a plain
  2D descriptor over the untiled array writes, and TMA masks that box at any
  ragged edge: rows past M, columns past K or N. So a copy Mosaic would
  refuse is issued as that box instead; every other copy is left exactly as
  Mosaic issues it. TMA still needs each array row to start at a multiple of
  16 bytes (`core.memory.TMA_MIN_BYTES`).

  Replaces `LaunchContext.async_copy`, once per process; it applies to the
  Mosaic GPU lowering of every kernel compiled after the call (interpret
  mode never reaches it). Measured on an H200 (docs/performance-log.md, "Ragged edges
  as 2D TMA boxes"): the copies
  run as fast as tiled ones, and the operands and outputs they reach need
  no padding copies.
  """
  global _boxed_copies_installed
  check_jax_version()
  if _boxed_copies_installed:
    return
  from jax.experimental.mosaic.gpu import launch_context, utils
  from jaxlib.mlir import ir

  tiled_copy = launch_context.LaunchContext.async_copy

  def async_copy(self, *, src_ref, dst_ref, gmem_transform=(), swizzle=None, **kwargs):
    transforms = gmem_transform if isinstance(gmem_transform, tuple) else (gmem_transform,)
    loads = utils.is_smem_ref(dst_ref.type)
    smem_ref, gmem_ref = (dst_ref, src_ref) if loads else (src_ref, dst_ref)
    if len(transforms) == 1 and swizzle is not None:
      tile = transforms[0]
      smem_shape = tuple(ir.MemRefType(smem_ref.type).shape)
      gmem_type = ir.MemRefType(gmem_ref.type)
      if (isinstance(tile, launch_context.TileTransform) and tile.rounding is None
          and len(tile.tiling) == 2 and len(smem_shape) == 4 and len(gmem_type.shape) >= 2):
        rows, segment = tile.tiling
        one_segment = (smem_shape[1:] == (1, rows, segment)
                       and segment * utils.bitwidth(gmem_type.element_type) == int(swizzle) * 8)
        refused = any(dim % t for dim, t in zip(gmem_type.shape[-2:], tile.tiling, strict=True))
        if one_segment and refused:
          box = utils.memref_reshape(smem_ref, (smem_shape[0] * rows, segment))
          src_ref, dst_ref = (src_ref, box) if loads else (box, dst_ref)
          transforms = ()
    return tiled_copy(self, src_ref=src_ref, dst_ref=dst_ref, gmem_transform=transforms,
                      swizzle=swizzle, **kwargs)

  launch_context.LaunchContext.async_copy = async_copy
  _boxed_copies_installed = True


# --- Distributed runtime --------------------------------------------------------------


def detach_coordination_service():
  """Takes the coordination service (rank 0's, else None) out of jax's distributed state.

  `jax.distributed.shutdown` stops the service together with the client;
  detached, the service is the caller's to stop (`.shutdown()`) when it
  chooses.
  """
  check_jax_version()
  from jax._src import distributed

  service, distributed.global_state.service = distributed.global_state.service, None
  return service
