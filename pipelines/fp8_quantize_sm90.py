"""FP8 quantization of a tensor in both of its layouts, from one read (sm_90).

An FP8 training step multiplies each of its tensors twice, once as stored and
once transposed (x in the forward and, as x.T, in the weight gradient), and
e4m3 wgmmas read both operands K-major, so each tensor is quantized in two
layouts: `quantize_fp8(x)` and `quantize_fp8(x.T)`. XLA needs a pass over x
for each (the block maxima must be known before the values are divided, and
the transpose is a pass of its own). A (1, 128) block of x and one of x.T (a
(128, 1) block of x) both lie within one aligned 128x128 tile, so this kernel
takes each tile into SMEM once and writes both layouts and their scales:

  - the tile's rows, read into registers, quantized along their 128 columns;
  - its columns as rows, out of the tensor cores: the 64x64 identity times
    each half of the tile read transposed (`wgmma` reads a transposed 16-bit
    operand from SMEM), exact in the float32 accumulator, quantized the same way.

One block per tile and one warpgroup per block; blocks overlap one another's
loads and stores. The values and scales are those of `quantize_fp8`, bit
for bit: the same maxima and scales, and the values times the scales'
reciprocals, as XLA computes `quantize_fp8`'s division, rounded to e4m3. One
exception: a zero of x.T's layout may have the other sign (the identity's
products sum a -0 to +0), which no product that reads the values can tell
apart. And a non-finite element of x, times the identity's zeros, spreads NaN
over 64 elements of x.T's layout, where `quantize_fp8` makes one NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import accumulator, barrier, compiler_params, interpret_params, smem
from core.varying import varying_kernel
from pipelines.config import FP8_DTYPE, FP8_SCALE_BLOCK
from pipelines.fp8_quantize import (
    ROW_BLOCK,
    SQUARE_BLOCK,
    block_scales,
    check_block,
    check_quantizable,
    quantize_fp8,
    scales_shape,
)
from pipelines.operands import round_up, zero_pad

TILE = FP8_SCALE_BLOCK
# A warpgroup's wgmma covers 64 rows: the tile goes through in two halves.
HALF = 64
# Operands the tensor cores can move exactly: 16-bit floats. A float32 tensor
# takes `quantize_fp8` twice.
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def quantize_fp8_both_layouts(x: jax.Array, block: tuple[int, int] = ROW_BLOCK
                              ) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
  """`(quantize_fp8(x, block), quantize_fp8(x.T, block))`, from one read of x.

  Args:
    x: (R, C) bfloat16 or float16 (one kernel; R and C padded to multiples of
      128 where they are not, a copy), or float32 (`quantize_fp8` twice).
    block: `ROW_BLOCK` (1, 128) or `SQUARE_BLOCK` (128, 128), for both layouts.

  Returns:
    ((values (R, C), scales), (values_t (C, R), scales_t)), float8_e4m3fn
    values and float32 scales as `quantize_fp8` returns them for x and x.T,
    bit for bit, but for the sign of some zeros of values_t (a -0 of x
    comes out +0) and for a non-finite x[r, c], which makes values_t[c2, r]
    NaN for each c2 of the 64-aligned 64 that hold c, not for c alone.
  """
  block = check_block(block)
  check_quantizable(x)
  if jnp.dtype(x.dtype) not in _KERNEL_DTYPES:
    return quantize_fp8(x, block), quantize_fp8(x.T, block)
  return _quantize_both_layouts(x, block)


@functools.partial(jax.jit, static_argnames="block")
def _quantize_both_layouts(x: jax.Array, block: tuple[int, int]):
  rows, cols = x.shape
  if not (rows and cols):
    return quantize_fp8(x, block), quantize_fp8(x.T, block)
  padded = zero_pad(x, (round_up(rows, TILE), round_up(cols, TILE)))
  padded_rows, padded_cols = padded.shape
  out_type = (jax.ShapeDtypeStruct((padded_rows, padded_cols), FP8_DTYPE),
              jax.ShapeDtypeStruct((padded_cols // TILE, padded_rows), jnp.float32),
              jax.ShapeDtypeStruct((padded_cols, padded_rows), FP8_DTYPE),
              jax.ShapeDtypeStruct((padded_rows // TILE, padded_cols), jnp.float32))
  values, scales_of_rows, values_t, scales_of_columns = varying_kernel(plgpu.kernel(
      functools.partial(_quantize_tile, square=block == SQUARE_BLOCK),
      out_type=out_type,
      grid=(padded_rows // TILE, padded_cols // TILE),
      grid_names=("rows", "columns"),
      compiler_params=compiler_params(),
      interpret=interpret_params(),
      kernel_name="fp8_quantize_both_layouts",
  ))(padded)
  # Each block wrote its rows' (its columns') scales as a row: transposed here,
  # where a square block's scale repeats 128 times.
  scales, scales_t = scales_of_rows.T, scales_of_columns.T
  if block == SQUARE_BLOCK:
    scales, scales_t = scales[::TILE], scales_t[::TILE]
  scale_rows, scale_cols = scales_shape((rows, cols), block)
  scale_t_rows, scale_t_cols = scales_shape((cols, rows), block)
  scales, scales_t = scales[:scale_rows, :scale_cols], scales_t[:scale_t_rows, :scale_t_cols]
  return (values[:rows, :cols], scales), (values_t[:cols, :rows], scales_t)


def _quantize_tile(x_gmem, values_gmem, scales_gmem, values_t_gmem, scales_t_gmem, *,
                   square: bool) -> None:
  """One 128x128 tile of x (`quantize_fp8_both_layouts`). Writes the tile's
  values, its rows' scales as row `columns` of scales_gmem (C / 128, R),
  the transposed tile's values, and its columns' scales as row `rows` of
  scales_t_gmem (R / 128, C). With `square`, every scale is the tile's."""
  tile_rows = pl.ds(lax.axis_index("rows") * TILE, TILE)
  tile_cols = pl.ds(lax.axis_index("columns") * TILE, TILE)

  def scoped(x_smem, eye_smem, values_smem, values_t_smem, scales_smem, scales_t_smem, loaded):
    plgpu.copy_gmem_to_smem(x_gmem.at[tile_rows, tile_cols], x_smem, loaded)
    # The identity is the LHS of the products that read the tile's columns as rows.
    row = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (HALF, HALF), 0),
                            plgpu.Layout.WGMMA)
    col = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (HALF, HALF), 1),
                            plgpu.Layout.WGMMA)
    eye_smem[...] = jnp.where(row == col, 1.0, 0.0).astype(eye_smem.dtype)
    plgpu.commit_smem()  # Written from registers, read by the wgmmas.
    plgpu.barrier_wait(loaded)

    halves = [pl.ds(h * HALF, HALF) for h in range(TILE // HALF)]

    def rows_of(half):
      return plgpu.load(x_smem.at[half], layout=plgpu.Layout.WGMMA).astype(jnp.float32)

    def columns_of(half):
      def transposed(acc_ref):
        # (64, 64) identity @ (64, 128): the tile's columns `half`, as rows.
        plgpu.wgmma(acc_ref, eye_smem, x_smem.at[:, half].T)
        return acc_ref[...]
      return pl.run_scoped(transposed, accumulator((HALF, TILE)))

    def row_maxima(value):
      return jnp.max(jnp.abs(value), axis=1)

    # With square blocks, one scale for the tile in both layouts: a first pass
    # over its rows takes their largest magnitude, and each half is read again.
    tile_max = (functools.reduce(jnp.maximum,
                                 [jnp.max(row_maxima(rows_of(half))) for half in halves])
                if square else None)

    def maxima_of(value):
      return jnp.full((HALF,), tile_max, jnp.float32) if square else row_maxima(value)
    # Half by half, so that at most one half of each layout is in registers.
    for half in halves:
      value = rows_of(half)
      _store_quantized(value, block_scales(maxima_of(value)), values_smem.at[half],
                       scales_smem.at[0, half])
      value = columns_of(half)
      _store_quantized(value, block_scales(maxima_of(value)), values_t_smem.at[half],
                       scales_t_smem.at[0, half])
    plgpu.commit_smem()  # Register stores must be visible to the TMA engine.
    plgpu.copy_smem_to_gmem(values_smem, values_gmem.at[tile_rows, tile_cols])
    plgpu.copy_smem_to_gmem(values_t_smem, values_t_gmem.at[tile_cols, tile_rows])
    plgpu.copy_smem_to_gmem(scales_smem,
                            scales_gmem.at[pl.ds(lax.axis_index("columns"), 1), tile_rows])
    plgpu.copy_smem_to_gmem(scales_t_smem,
                            scales_t_gmem.at[pl.ds(lax.axis_index("rows"), 1), tile_cols])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(scoped,
                smem((TILE, TILE), x_gmem.dtype, swizzled=True),
                smem((HALF, HALF), x_gmem.dtype, swizzled=True),
                smem((TILE, TILE), FP8_DTYPE, swizzled=True),
                smem((TILE, TILE), FP8_DTYPE, swizzled=True),
                plgpu.SMEM((1, TILE), jnp.float32),
                plgpu.SMEM((1, TILE), jnp.float32),
                barrier())


def _store_quantized(value, scales, values_smem, scales_smem) -> None:
  """(64, 128) float32 `value` times the reciprocals of its rows' `scales`,
  rounded to e4m3, into `values_smem`; the scales into `scales_smem` (64,).
  XLA computes `quantize_fp8`'s division by a broadcast scale the same way
  (a reciprocal, then products), which an exact division does not match at
  every rounding tie of e4m3."""
  reciprocals = lax.broadcast_in_dim(1.0 / scales, value.shape, (0,))
  values_smem[...] = (value * reciprocals).astype(FP8_DTYPE)
  scales_smem[...] = scales
