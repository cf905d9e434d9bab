"""Memory spaces, scratch allocation and the SMEM layouts that TMA and wgmma need.

Hopper kernels move data GMEM -> SMEM (TMA) -> tensor cores -> registers (the
wgmma accumulator) -> SMEM -> GMEM (TMA). This module names those spaces once and
builds the allocations a kernel asks for:

* kernel-lifetime scratch: pass `smem(...)`/`barrier(...)` in `plgpu.kernel`'s
  `scratch_types`;
* scoped scratch: pass them as keyword arguments of `pl.run_scoped`;
* the wgmma accumulator (`accumulator(...)`, memory space REGS) must get its own
  `pl.run_scoped`: Mosaic GPU refuses REGS allocations mixed with other spaces
  in one scope.

TMEM exists only on Blackwell; it is named here so that code can say so, and
`require_space` rejects it for these Hopper kernels.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core.device import WGMMA_M, WGMMA_N_MULTIPLE

GMEM = plgpu.GMEM
SMEM = plgpu.SMEM
TMEM = plgpu.TMEM
REGS = plgpu.REGS

# The swizzle modes of TMA and wgmma, in bytes of one swizzled row segment.
SWIZZLE_BYTES = (128, 64, 32)
# Rows of the (8, swizzle) tiles that wgmma operands are laid out in.
TILE_ROWS = 8
# TMA moves whole 16-byte units along the minor dimension, and each array row
# it reads or writes must start at a multiple of 16 bytes.
TMA_MIN_BYTES = 16
# A TMA copy's box is at most this many elements along each dimension.
TMA_MAX_BOX = 256
HOPPER_MEMORY_SPACES = (GMEM, SMEM, REGS)


def require_space(space: plgpu.MemorySpace, *, what: str) -> None:
  """Raises `ValueError` if `space` does not exist on Hopper."""
  if space not in HOPPER_MEMORY_SPACES:
    raise ValueError(
        f"{what}: memory space {space} does not exist on Hopper (sm_90); "
        f"valid spaces are {[str(s) for s in HOPPER_MEMORY_SPACES]}")


def swizzle_bytes(minor_dim: int, dtype, *, what: str = "tile") -> int:
  """The widest swizzle whose row segment divides a tile row of `minor_dim` elements.

  Raises `ValueError` if a row is not a multiple of 32 bytes (the narrowest
  swizzle), which wgmma operands require.
  """
  if minor_dim <= 0:
    raise ValueError(f"{what}: minor dimension must be positive, got {minor_dim}")
  row_bytes = minor_dim * jnp.dtype(dtype).itemsize
  for swizzle in SWIZZLE_BYTES:
    if row_bytes % swizzle == 0:
      return swizzle
  raise ValueError(
      f"{what}: a row of {minor_dim} x {jnp.dtype(dtype).name} is {row_bytes} bytes; "
      f"swizzled SMEM tiles need a multiple of {min(SWIZZLE_BYTES)} bytes "
      f"(minor dimension a multiple of {min(SWIZZLE_BYTES) // jnp.dtype(dtype).itemsize})")


def swizzle_elems(minor_dim: int, dtype, *, what: str = "tile") -> int:
  """Elements in one swizzled row segment: GMEM dims TMA tiles must divide."""
  return swizzle_bytes(minor_dim, dtype, what=what) // jnp.dtype(dtype).itemsize


def tma_boxes(length: int) -> list[pl.Slice]:
  """Slices of [0, `length`) of at most `TMA_MAX_BOX` elements each: the TMA
  copies that move a 1-D run of that length."""
  return [pl.ds(start, min(TMA_MAX_BOX, length - start))
          for start in range(0, length, TMA_MAX_BOX)]


def tma_copies_in_place(tile_minor: int, array_minor: int, dtype, swizzle: int) -> bool:
  """Whether TMA copies SMEM tiles `tile_minor` elements wide, swizzled by
  `swizzle` bytes, to or from a GMEM array whose minor dimension is
  `array_minor`, with no padding of the array.

  Mosaic GPU tiles the array like the SMEM tile, so the swizzle's row
  segment must divide the array's minor dimension (and 8 its major one).
  A tile one segment wide is copied as a plain 2D box instead
  (`core.jax_private.copy_one_segment_tiles_as_boxes`), which TMA masks at any
  edge: it needs only each row to start at a multiple of `TMA_MIN_BYTES`.
  """
  itemsize = jnp.dtype(dtype).itemsize
  if tile_minor * itemsize == swizzle:
    return array_minor * itemsize % TMA_MIN_BYTES == 0
  return array_minor * itemsize % swizzle == 0


def tma_swizzle(tile_minor_dims, array_minor_dims, dtype,
                swizzles: tuple[int, ...] = SWIZZLE_BYTES) -> int:
  """The widest swizzle (bytes) for SMEM tiles that TMA copies to or from GMEM arrays.

  `tile_minor_dims[i]` is the minor dimension (elements of `dtype`) of the
  tiles copied to or from the array whose minor dimension is
  `array_minor_dims[i]`. The swizzle's row segment must divide every tile's
  minor dimension, and TMA must copy each tile in place
  (`tma_copies_in_place`). The widest swizzle is the fastest; a narrower one
  lets an array whose minor dimension is off 128 bytes be read in place
  rather than copied into a padded one. Only `swizzles` (bytes) are
  considered. Raises `ValueError` where none of them fits.
  """
  itemsize = jnp.dtype(dtype).itemsize
  pairs = tuple(zip(tile_minor_dims, array_minor_dims, strict=True))
  for swizzle in sorted(swizzles, reverse=True):
    if all(tile * itemsize % swizzle == 0 and tma_copies_in_place(tile, array, dtype, swizzle)
           for tile, array in pairs):
      return swizzle
  raise ValueError(
      f"no swizzle fits (tile, array) minor dimensions {pairs} of {jnp.dtype(dtype).name}: "
      f"TMA tiles need multiples of {min(swizzles) // itemsize} elements "
      f"({min(swizzles)} bytes)")


def tile_transforms(minor_dim: int, dtype, *, what: str = "tile",
                    swizzle: int | None = None) -> tuple:
  """The (tiling, swizzle) transforms for an SMEM tile read by TMA and wgmma.

  Args:
    minor_dim: elements along the tile's minor (contiguous) dimension.
    dtype: element type of the tile.
    what: name of the tile for error messages.
    swizzle: the swizzle in bytes (`tma_swizzle`); by default the widest that
      divides a tile row.
  """
  if swizzle is None:
    swizzle = swizzle_bytes(minor_dim, dtype, what=what)
  elif swizzle not in SWIZZLE_BYTES or minor_dim * jnp.dtype(dtype).itemsize % swizzle:
    raise ValueError(f"{what}: swizzle={swizzle} must be one of {SWIZZLE_BYTES} and divide "
                     f"a row of {minor_dim} x {jnp.dtype(dtype).name}")
  return (plgpu.TilingTransform((TILE_ROWS, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def smem(shape: tuple[int, ...], dtype, *, swizzled: bool = False, swizzle: int | None = None):
  """An SMEM allocation; `swizzled=True` lays it out for TMA + wgmma (with
  `swizzle` bytes, by default the widest a row allows)."""
  if any(d <= 0 for d in shape):
    raise ValueError(f"SMEM shape must be positive, got {shape}")
  transforms = tile_transforms(shape[-1], dtype, swizzle=swizzle) if swizzled else ()
  return plgpu.SMEM(shape, dtype, transforms=transforms)


def store_tile(value, out_gmem) -> None:
  """Stores a register tile to `out_gmem` (a GMEM ref of its shape) with TMA,
  staged in a swizzled SMEM tile of `out_gmem`'s dtype in a scope of its own,
  and waits until the copy has read SMEM (its GMEM write completes on its
  own), so the scope's SMEM may be reused as soon as this returns."""
  def store(out_smem):
    out_smem[...] = value.astype(out_smem.dtype)
    plgpu.commit_smem()  # Register stores must be visible to the TMA engine.
    plgpu.copy_smem_to_gmem(out_smem, out_gmem)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(store, smem(out_gmem.shape, out_gmem.dtype, swizzled=True))


def accumulator(shape: tuple[int, int]):
  """A float32 wgmma accumulator in registers (its own `pl.run_scoped`!)."""
  m, n = shape
  if m % WGMMA_M or n % WGMMA_N_MULTIPLE:
    raise ValueError(f"wgmma accumulator must be ({WGMMA_M}k, {WGMMA_N_MULTIPLE}j), got {shape}")
  return plgpu.ACC(shape, jnp.float32)


def barrier(*, num_barriers: int = 1, num_arrivals: int = 1):
  """SMEM mbarriers: TMA completion or cross-warpgroup signalling."""
  if num_barriers < 1 or num_arrivals < 1:
    raise ValueError(f"{num_barriers=} and {num_arrivals=} must be >= 1")
  return plgpu.Barrier(num_arrivals=num_arrivals, num_barriers=num_barriers)
