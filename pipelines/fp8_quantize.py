"""FP8 (e4m3) quantization with one float32 scale per block: its blocks and
scales, and its formulation in XLA (`quantize_fp8_reference`).

A tensor is quantized per block: each block of its elements is divided by a
float32 scale, its largest magnitude over e4m3's largest finite value (448),
and rounded to e4m3, so one outlier sets the scale of its own block only.
Activations take blocks of 1x128 along K (a row's block), weights 128x128,
as FP8 training recipes do (DeepSeek-V3's). `quantize_fp8`
(`fp8_quantize_sm90`) runs a kernel for 16-bit tensors and this formulation
for float32 ones; the tests take this one as the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pipelines.config import FP8_DTYPE, FP8_SCALE_BLOCK
from pipelines.operands import zero_pad

# The largest finite e4m3 value: a block's largest magnitude maps to it.
E4M3_MAX = float(jnp.finfo(FP8_DTYPE).max)
# Blocks `quantize_fp8` takes: a row's 128 elements (activations, the LHS)
# or 128x128 (weights, the RHS).
ROW_BLOCK = (1, FP8_SCALE_BLOCK)
SQUARE_BLOCK = (FP8_SCALE_BLOCK, FP8_SCALE_BLOCK)
BLOCKS = (ROW_BLOCK, SQUARE_BLOCK)
_QUANTIZABLE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def scales_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
  """The shape of the scales of a (rows, columns) tensor quantized in `block`s."""
  return tuple(-(-size // b) for size, b in zip(shape, block, strict=True))


def rhs_scales_block(rhs_shape: tuple[int, int], rhs_scales_shape: tuple) -> tuple[int, int]:
  """The block an (N, K) RHS's scales of `rhs_scales_shape` describe (as
  `fp8_matmul` takes them): `ROW_BLOCK` for one per row, (N, ceil(K / 128));
  else `SQUARE_BLOCK` (also for one scale, (), and for N = 1, where the two
  shapes are one and mean the same)."""
  row_shape = scales_shape(rhs_shape, ROW_BLOCK)
  if tuple(rhs_scales_shape) == row_shape != scales_shape(rhs_shape, SQUARE_BLOCK):
    return ROW_BLOCK
  return SQUARE_BLOCK


def block_scales(amax: jax.Array) -> jax.Array:
  """The scales of blocks whose largest magnitudes are `amax` (float32): the
  largest maps to e4m3's largest value; a block of zeros gets 1. An `amax`
  of NaN (where the maximum kept a NaN) gives scale NaN and one of inf
  scale inf, so that the block dequantizes to NaN whole (a test `amax > 0`
  would give a NaN's block scale 1, its other elements rounded unscaled)."""
  return jnp.where(amax == 0, 1.0, amax / E4M3_MAX)


def check_block(block) -> tuple[int, int]:
  """`block` as a tuple; raises unless it is one of `BLOCKS`."""
  block = tuple(block)
  if block not in BLOCKS:
    raise ValueError(f"block={block} must be one of {BLOCKS}")
  return block


def quantize_fp8_reference(x: jax.Array, block: tuple[int, int] = ROW_BLOCK
                           ) -> tuple[jax.Array, jax.Array]:
  """`quantize_fp8` in XLA: a pass that takes the blocks' largest magnitudes,
  then one that divides and rounds (x.T, where a caller passes one, is a
  pass of its own). The same arguments and results as `quantize_fp8`
  without `transpose`; `quantize_fp8` runs it for float32 tensors, and for
  16-bit ones it is the reference that the kernel matches bit for bit."""
  block = check_block(block)
  check_quantizable(x)
  return _quantize(x, block)


def check_quantizable(x: jax.Array) -> None:
  """Raises unless `x` is 2-D float32, bfloat16 or float16."""
  if x.ndim != 2:
    raise ValueError(f"x must be 2-D (rows, columns), got {x.shape=}")
  if jnp.dtype(x.dtype) not in _QUANTIZABLE_DTYPES:
    raise ValueError(f"x.dtype={jnp.dtype(x.dtype).name} must be one of "
                     f"{[d.name for d in _QUANTIZABLE_DTYPES]}")


@functools.partial(jax.jit, static_argnames="block")
def _quantize(x: jax.Array, block: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
  rows, cols = x.shape
  blocks = scales_shape(x.shape, block)
  padded = zero_pad(x.astype(jnp.float32), tuple(b * size for b, size in
                                                 zip(blocks, block, strict=True)))
  tiles = padded.reshape(blocks[0], block[0], blocks[1], block[1])
  scales = block_scales(jnp.max(jnp.abs(tiles), axis=(1, 3)))
  values = (tiles / scales[:, None, :, None]).astype(FP8_DTYPE)
  return values.reshape(padded.shape)[:rows, :cols], scales


def dequantize_fp8(values: jax.Array, scales: jax.Array,
                   block: tuple[int, int] = ROW_BLOCK) -> jax.Array:
  """values * scales per block, in float32: the inverse of `quantize_fp8`.

  Args:
    values: (R, C) float8_e4m3fn.
    scales: float32, (ceil(R / block[0]), ceil(C / block[1])), or () for
      one scale for the whole tensor.
    block: as `quantize_fp8` took it.
  """
  block = check_block(block)
  if values.ndim != 2 or jnp.dtype(values.dtype) != FP8_DTYPE:
    raise ValueError(f"values must be 2-D (R, C) {jnp.dtype(FP8_DTYPE).name}, got {values.shape} "
                     f"{jnp.dtype(values.dtype).name}")
  scales = jnp.asarray(scales, jnp.float32)
  if scales.shape not in ((), scales_shape(values.shape, block)):
    raise ValueError(f"scales must have shape {scales_shape(values.shape, block)} (one per "
                     f"{block} block of values {values.shape}) or () (one for all), got "
                     f"{scales.shape}")
  if scales.ndim:
    scales = jnp.repeat(jnp.repeat(scales, block[0], axis=0), block[1], axis=1)
    scales = scales[:values.shape[0], :values.shape[1]]
  return values.astype(jnp.float32) * scales
