"""FP8 quantization of a tensor in one or both of its layouts, from one read (sm_90):
`quantize_fp8` and `quantize_fp8_both_layouts`.

An FP8 training step multiplies each of its tensors twice, once as stored and
once transposed (x in the forward and, as x.T, in the weight gradient), and
e4m3 wgmmas read both operands K-major, so each tensor is quantized in two
layouts: x and x.T, each in its own blocks. XLA needs a pass over x
for each (the block maxima must be known before the values are divided, and
the transpose is a pass of its own). A (1, 128) block of x and one of x.T (a
(128, 1) block of x) both lie within one aligned 128x128 tile, so this kernel
takes each tile into SMEM once and writes both layouts and their scales
(`quantize_fp8_both_layouts`), or one of them (`quantize_fp8`, which spares
XLA's second read of x, and its transpose's pass for x.T):

  - the tile's rows, read into registers, quantized along their 128 columns;
  - its columns as rows, out of the tensor cores: the 64x64 identity times
    each half of the tile read transposed (`wgmma` reads a transposed 16-bit
    operand from SMEM), exact in the float32 accumulator, quantized the same way.

One block per tile and one warpgroup per block; blocks overlap one another's
loads and stores. The values and scales are those of XLA's
`quantize_fp8_reference`, bit for bit: the same maxima and scales, and the
values times the scales' reciprocals, as XLA computes its division, rounded
to e4m3. One
exception: a zero of x.T's layout may have the other sign (the identity's
products sum a -0 to +0), which no product that reads the values can tell
apart. And a non-finite element of x, times the identity's zeros, spreads NaN
over 64 elements of x.T's layout, where XLA makes one NaN.
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
    quantize_fp8_reference,
    scales_shape,
)
from pipelines.operands import round_up, zero_pad

TILE = FP8_SCALE_BLOCK
# A warpgroup's wgmma covers 64 rows: the tile goes through in two halves.
HALF = 64
# Operands the tensor cores can move exactly: 16-bit floats. A float32 tensor
# takes `quantize_fp8_reference`.
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _kernel_quantizes(x: jax.Array) -> bool:
  """Whether the kernel takes `x`: 16-bit and not empty (an empty x has no
  tile to launch a block for)."""
  return jnp.dtype(x.dtype) in _KERNEL_DTYPES and x.size > 0


def quantize_fp8_both_layouts(x: jax.Array, block: tuple[int, int] = ROW_BLOCK
                              ) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
  """`(quantize_fp8(x, block), quantize_fp8(x, block, transpose=True))`, from
  one read of x.

  Args:
    x: (R, C) bfloat16 or float16 (one kernel; R and C padded to multiples of
      128 where they are not, a copy), or float32 (`quantize_fp8_reference`
      twice).
    block: `ROW_BLOCK` (1, 128) or `SQUARE_BLOCK` (128, 128), for both layouts.

  Returns:
    ((values (R, C), scales), (values_t (C, R), scales_t)), float8_e4m3fn
    values and float32 scales as `quantize_fp8_reference` returns them for x
    and x.T, bit for bit, but for the sign of some zeros of values_t (a -0
    of x comes out +0) and for a non-finite x[r, c], which makes
    values_t[c2, r] NaN for each c2 of the 64-aligned 64 that hold c, not
    for c alone.
  """
  block = check_block(block)
  check_quantizable(x)
  if not _kernel_quantizes(x):
    return quantize_fp8_reference(x, block), quantize_fp8_reference(x.T, block)
  return _quantize_layouts(x, block, as_stored=True, transposed=True)


def quantize_fp8(x: jax.Array, block: tuple[int, int] = ROW_BLOCK, *,
                 transpose: bool = False) -> tuple[jax.Array, jax.Array]:
  """Quantizes `x` (or x.T, with `transpose`) to e4m3 with one float32 scale
  per block.

  A 16-bit x goes through one kernel that reads each 128x128 tile of it into
  SMEM once, where XLA (`quantize_fp8_reference`) reads it twice, once for
  the block maxima and once to divide and round, and a transposed operand
  costs it the transpose's pass as well. float32 goes through
  `quantize_fp8_reference`.

  Args:
    x: (R, C) bfloat16 or float16 (one kernel; R and C padded to multiples of
      128 where they are not, a copy), or float32. Finite: a NaN or inf
      dequantizes to NaN, and may take its block's other elements with it
      (their scale is then NaN or inf).
    block: (1, 128): a scale per row and 128 columns (an activation, whose
      columns are K); (128, 128): per 128x128 block (a weight stored (N, K)).
      Blocks at the edges may be partial.
    transpose: quantize x.T (C, R), e.g. a (K, N) weight as `fp8_matmul`'s
      (N, K) RHS, without writing x.T first.

  Returns:
    (values, scales) of y = x (or x.T): values (rows, columns) float8_e4m3fn
    and scales (ceil(rows / block[0]), ceil(columns / block[1])) float32,
    with y[r, c] close to values[r, c] * scales[r // block[0], c // block[1]]:
    within 2**-4 of |y[r, c]| (e4m3 keeps 3 mantissa bits) plus 2**-10 times
    the block's scale (half of e4m3's smallest subnormal step, for elements
    more than 2**8 times smaller than their block's largest). A block of
    zeros has scale 1. Bit for bit `quantize_fp8_reference`'s, but with
    `transpose` for the exceptions `quantize_fp8_both_layouts` states for
    x.T's layout.
  """
  block = check_block(block)
  check_quantizable(x)
  if not _kernel_quantizes(x):
    return quantize_fp8_reference(x.T if transpose else x, block)
  (layout,) = _quantize_layouts(x, block, as_stored=not transpose, transposed=transpose)
  return layout


@functools.partial(jax.jit, static_argnames=("block", "as_stored", "transposed"))
def _quantize_layouts(x: jax.Array, block: tuple[int, int], *, as_stored: bool,
                      transposed: bool) -> tuple[tuple[jax.Array, jax.Array], ...]:
  """(values, scales) of x as stored and/or of x.T (in that order), from one
  kernel over x's 128x128 tiles; x is 16-bit and not empty."""
  rows, cols = x.shape
  padded = zero_pad(x, (round_up(rows, TILE), round_up(cols, TILE)))
  padded_rows, padded_cols = padded.shape
  # Each tile writes its rows' (its columns') scales as a row of its own.
  layouts = [((rows, cols), (padded_rows, padded_cols))] if as_stored else []
  if transposed:
    layouts.append(((cols, rows), (padded_cols, padded_rows)))
  out_type = []
  for _, (out_rows, out_cols) in layouts:
    out_type += [jax.ShapeDtypeStruct((out_rows, out_cols), FP8_DTYPE),
                 jax.ShapeDtypeStruct((out_cols // TILE, out_rows), jnp.float32)]
  written = varying_kernel(plgpu.kernel(
      functools.partial(_quantize_tile, square=block == SQUARE_BLOCK, as_stored=as_stored,
                        transposed=transposed),
      out_type=tuple(out_type),
      grid=(padded_rows // TILE, padded_cols // TILE),
      grid_names=("rows", "columns"),
      compiler_params=compiler_params(),
      interpret=interpret_params(),
      kernel_name=_KERNEL_NAMES[as_stored, transposed],
  ))(padded)
  results = []
  for ((out_rows, out_cols), _), values, scales_of_rows in zip(
      layouts, written[::2], written[1::2], strict=True):
    # Transposed here, where a square block's scale repeats 128 times.
    scales = scales_of_rows.T[::TILE] if block == SQUARE_BLOCK else scales_of_rows.T
    scale_rows, scale_cols = scales_shape((out_rows, out_cols), block)
    results.append((values[:out_rows, :out_cols], scales[:scale_rows, :scale_cols]))
  return tuple(results)


# By the layouts a kernel writes: (as stored, transposed).
_KERNEL_NAMES = {(True, True): "fp8_quantize_both_layouts", (True, False): "fp8_quantize",
                 (False, True): "fp8_quantize_transposed"}


def _quantize_tile(x_gmem, *out_gmem, square: bool, as_stored: bool, transposed: bool) -> None:
  """One 128x128 tile of x (`_quantize_layouts`). As stored, it writes the
  tile's values and its rows' scales as row `columns` of that layout's scales
  (C / 128, R); transposed, the transposed tile's values and its columns'
  scales as row `rows` of (R / 128, C). With `square`, every scale is the
  tile's."""
  tile_rows = pl.ds(lax.axis_index("rows") * TILE, TILE)
  tile_cols = pl.ds(lax.axis_index("columns") * TILE, TILE)
  out_gmem = iter(out_gmem)
  values_gmem, scales_gmem = (next(out_gmem), next(out_gmem)) if as_stored else (None, None)
  values_t_gmem, scales_t_gmem = (next(out_gmem), next(out_gmem)) if transposed else (None, None)

  def scoped(x_smem, loaded, values_smem=None, scales_smem=None, eye_smem=None,
             values_t_smem=None, scales_t_smem=None):
    plgpu.copy_gmem_to_smem(x_gmem.at[tile_rows, tile_cols], x_smem, loaded)
    if transposed:
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
      def transposed_half(acc_ref):
        # (64, 64) identity @ (64, 128): the tile's columns `half`, as rows.
        plgpu.wgmma(acc_ref, eye_smem, x_smem.at[:, half].T)
        return acc_ref[...]
      return pl.run_scoped(transposed_half, accumulator((HALF, TILE)))

    def row_maxima(value):
      return jnp.max(jnp.abs(value), axis=1)

    # With square blocks, one scale for the tile in every layout: a first pass
    # over its rows takes their largest magnitude, and each half is read again.
    tile_max = (functools.reduce(jnp.maximum,
                                 [jnp.max(row_maxima(rows_of(half))) for half in halves])
                if square else None)

    def maxima_of(value):
      return jnp.full((HALF,), tile_max, jnp.float32) if square else row_maxima(value)
    # Half by half, so that at most one half of each layout is in registers.
    for half in halves:
      if as_stored:
        value = rows_of(half)
        _store_quantized(value, block_scales(maxima_of(value)), values_smem.at[half],
                         scales_smem.at[0, half])
      if transposed:
        value = columns_of(half)
        _store_quantized(value, block_scales(maxima_of(value)), values_t_smem.at[half],
                         scales_t_smem.at[0, half])
    plgpu.commit_smem()  # Register stores must be visible to the TMA engine.
    if as_stored:
      plgpu.copy_smem_to_gmem(values_smem, values_gmem.at[tile_rows, tile_cols])
      plgpu.copy_smem_to_gmem(scales_smem,
                              scales_gmem.at[pl.ds(lax.axis_index("columns"), 1), tile_rows])
    if transposed:
      plgpu.copy_smem_to_gmem(values_t_smem, values_t_gmem.at[tile_cols, tile_rows])
      plgpu.copy_smem_to_gmem(scales_t_smem,
                              scales_t_gmem.at[pl.ds(lax.axis_index("rows"), 1), tile_cols])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  scratch = dict(x_smem=smem((TILE, TILE), x_gmem.dtype, swizzled=True), loaded=barrier())
  if as_stored:
    scratch.update(values_smem=smem((TILE, TILE), FP8_DTYPE, swizzled=True),
                   scales_smem=plgpu.SMEM((1, TILE), jnp.float32))
  if transposed:
    scratch.update(eye_smem=smem((HALF, HALF), x_gmem.dtype, swizzled=True),
                   values_t_smem=smem((TILE, TILE), FP8_DTYPE, swizzled=True),
                   scales_t_smem=plgpu.SMEM((1, TILE), jnp.float32))
  pl.run_scoped(scoped, **scratch)


def _store_quantized(value, scales, values_smem, scales_smem) -> None:
  """(64, 128) float32 `value` times the reciprocals of its rows' `scales`,
  rounded to e4m3, into `values_smem`; the scales into `scales_smem` (64,).
  XLA computes `quantize_fp8_reference`'s division by a broadcast scale the
  same way (a reciprocal, then products), which an exact division does not
  match at every rounding tie of e4m3."""
  reciprocals = lax.broadcast_in_dim(1.0 / scales, value.shape, (0,))
  values_smem[...] = (value * reciprocals).astype(FP8_DTYPE)
  scales_smem[...] = scales
