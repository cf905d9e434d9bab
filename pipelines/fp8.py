"""`fp8_matmul`: FP8 (e4m3) operands quantized per block (`fp8_quantize`).

`fp8_matmul` multiplies two quantized operands on Hopper's FP8 tensor cores
and applies the scales inside the kernel, per K block, in float32
(`fp8_matmul_sm90`); `fp8_matmul_reference` is the same product of the
dequantized operands in float32. `fp8_linear` is the layer a model trains
with: it quantizes its bf16 operands and runs its forward and both backward
products on `fp8_matmul`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from core import device_facts
from core.varying import cotangent_like
from pipelines import heuristic, kernel_call, operands
from pipelines.batching import refusing_gradient
from pipelines.config import FP8_DTYPE, Fp8Config, TuningConfig
from pipelines.epilogue import Epilogue, checked_bias
from pipelines.fp8_quantize import (
    ROW_BLOCK,
    SQUARE_BLOCK,
    rhs_scales_block,
    scales_shape,
)
from pipelines.fp8_quantize_sm90 import quantize_fp8, quantize_fp8_both_layouts

# With one scale per operand the whole K sum can stay in the tensor cores, so
# the product runs on `matmul`'s persistent warp-specialized kernel, scaled in
# its epilogue: its 128x256 CTA tile (two 128x128 warpgroup tiles) with K
# steps of 128 bytes, as its bf16 tiles have, in 4 stages; 3 for a float32
# output, whose staging tiles take twice the SMEM. Not tuned.
PER_TENSOR_CONFIG = TuningConfig(tile_m=128, tile_n=128, tile_k=128, max_concurrent_steps=4)
_PER_TENSOR_FLOAT32_STAGES = 3
_NT = operands.OperandLayout(transpose_rhs=True)
_NOT_DIFFERENTIABLE = ("fp8_matmul is not differentiable (it takes quantized operands); use "
                       "pipelines.fp8_linear for an FP8 layer")


def _check_fp8_operand(name: str, x) -> None:
  if x.ndim != 2:
    raise ValueError(f"{name} must be 2-D, got {name}.shape={x.shape}")
  if jnp.dtype(x.dtype) != FP8_DTYPE:
    raise ValueError(f"{name}.dtype={jnp.dtype(x.dtype).name} must be {FP8_DTYPE.name} "
                     f"(quantize_fp8 makes it)")


def _check_scales(name: str, scales, expected: dict[tuple[int, int], str]) -> None:
  """Raises unless `scales` is float32 of shape () or one of `expected`'s
  shapes (keys; the values say what each means)."""
  if not hasattr(scales, "dtype") or jnp.dtype(scales.dtype) != jnp.float32:
    raise ValueError(f"{name} must be a float32 array, got "
                     f"{getattr(scales, 'dtype', type(scales).__name__)}")
  if scales.shape != () and scales.shape not in expected:
    shapes = " or ".join(f"{shape} ({what})" for shape, what in expected.items())
    raise ValueError(f"{name} must have shape {shapes} or () (one scale for the tensor), got "
                     f"{name}.shape={scales.shape}")


# A 192-row tile (three compute warpgroups) computes an output row 1.12x as
# fast as a 128-row tile (two): on an H100, 6144x4096x14336 and
# 12288x4096x4096 ran 1.10x and 1.12x faster with it, where its busiest SM
# computed 1.02x and 1.00x the rows (docs/performance-log.md, "A third compute
# warpgroup for the block-scaled FP8 kernel").
_THREE_WG_ROW_SPEEDUP = 1.12


def default_config(m: int, k: int, n: int, out_dtype=jnp.bfloat16, *, has_bias: bool = False,
                   rhs_row_scales: bool = False) -> Fp8Config:
  """The block-scaled kernel's config for an (M, K) x (K, N) product into
  `out_dtype`: three compute warpgroups (192-row tiles) unless the busiest
  SM's rows under two (128-row tiles; its waves of work items times their
  rows) are fewer by more than the larger tile's speed per row makes up for,
  as at a few hundred rows, where 192-row tiles compute up to half again the
  rows; in the deepest pipeline up to 4 stages whose SMEM fits (a float32
  output's staging tile leaves three warpgroups 3)."""
  def busiest_sm_rows(config: Fp8Config) -> int:
    tiles = -(-m // config.cta_tile_m) * -(-n // Fp8Config.TILE_N)
    return -(-tiles // device_facts().sm_count) * config.cta_tile_m
  two, three = Fp8Config(), Fp8Config(compute_wgs=3)
  config = three if busiest_sm_rows(three) <= _THREE_WG_ROW_SPEEDUP * busiest_sm_rows(two) else two
  k_steps = max(1, -(-k // Fp8Config.TILE_K))

  def fits(candidate: Fp8Config) -> bool:
    return candidate.smem_budget(k_steps, out_dtype, has_bias=has_bias,
                                 rhs_row_scales=rhs_row_scales).fits()

  deepest = heuristic.deepest_fitting(config, range(config.max_concurrent_steps, 1, -1), fits)
  return deepest or dataclasses.replace(config, max_concurrent_steps=1)


def _checked_config(config: Fp8Config | None) -> Fp8Config | None:
  """`config`; raises unless it is an `Fp8Config` or None (the problem's default)."""
  if config is not None and not isinstance(config, Fp8Config):
    raise ValueError(f"config must be an Fp8Config, got {type(config).__name__}")
  return config


def fp8_matmul(lhs: jax.Array, rhs: jax.Array, lhs_scales: jax.Array, rhs_scales: jax.Array,
               bias: jax.Array | None = None, *, activation: str = "none",
               out_dtype=jnp.bfloat16, config: Fp8Config | None = None) -> jax.Array:
  """`activation(dequantize(lhs) @ dequantize(rhs).T + bias)` on Hopper's FP8 tensor cores.

  Args:
    lhs: (M, K) float8_e4m3fn, quantized in (1, 128) blocks (`quantize_fp8`).
    rhs: (N, K) float8_e4m3fn: the weight stored transposed (wgmma reads
      8-bit operands K-major only), quantized in (128, 128) blocks, e.g.
      `quantize_fp8(w, SQUARE_BLOCK, transpose=True)` for a (K, N) weight
      `w`; or in (1, 128) blocks as the LHS is (`quantize_fp8(g, ROW_BLOCK,
      transpose=True)` for a weight gradient's cotangent `g`, whose columns
      differ in size).
    lhs_scales: (M, ceil(K / 128)) float32, or () for one scale for all of
      lhs.
    rhs_scales: (ceil(N / 128), ceil(K / 128)) float32 for (128, 128)
      blocks, (N, ceil(K / 128)) for (1, 128) blocks, or ().
    bias: (N,) of any float dtype, added in float32, or None.
    activation: "none", "relu", "gelu" (tanh approximation) or "silu".
    out_dtype: bfloat16 (default), float16 or float32; or float8_e4m3fn
      for the output quantized in (1, 128) blocks in the kernel's epilogue,
      ready to be the LHS of the next `fp8_matmul` with no pass of its own.
    config: the block-scaled kernel's; `default_config` of the problem by default.

  With block scales, each 128-long block of K is multiplied on the tensor
  cores and added, times its two scales, to a float32 sum outside them, so
  the error does not grow with K beyond float32 summation's (the tests bound
  it at K = 4096 against `fp8_matmul_reference`). With one scale for each
  operand (both () and a 16- or 32-bit output), the product runs on
  `matmul`'s persistent kernel (`PER_TENSOR_CONFIG`; `config` does not
  apply) and the tensor cores sum all of K, scaled once in the epilogue:
  faster, and its error grows with K as the tensor cores' sum does. Any M, N
  and K; operands are padded with zeros where the kernel needs. Not
  differentiable: it takes quantized operands; `fp8_linear` is the
  differentiable layer.

  Returns:
    (M, N) array of `out_dtype`; for float8_e4m3fn, (values (M, N),
    scales (M, ceil(N / 128)) float32), as `quantize_fp8(out, (1, 128))`
    would give them from the float32 result.
  """
  _check_fp8_operand("lhs", lhs)
  _check_fp8_operand("rhs", rhs)
  (m, k), (n, rhs_k) = lhs.shape, rhs.shape
  if k != rhs_k:
    raise ValueError(f"K of lhs (M, K) and rhs (N, K) differ: {lhs.shape=}, {rhs.shape=}")
  lhs_scales_shape = scales_shape((m, k), ROW_BLOCK)
  rhs_scales_shape = scales_shape((n, k), SQUARE_BLOCK)
  rhs_row_scales_shape = scales_shape((n, k), ROW_BLOCK)
  _check_scales("lhs_scales", lhs_scales, {lhs_scales_shape: "one per row and 128 of K"})
  _check_scales("rhs_scales", rhs_scales, {rhs_scales_shape: "one per 128 of N and 128 of K",
                                           rhs_row_scales_shape: "one per row and 128 of K"})
  rhs_row_scales = rhs_scales_block((n, k), rhs_scales.shape) == ROW_BLOCK
  if jnp.dtype(out_dtype) != FP8_DTYPE:
    out_dtype = operands.check_out_dtype(out_dtype, jnp.bfloat16)
  epilogue = Epilogue(activation=activation, has_bias=bias is not None)
  bias = checked_bias(bias, n)
  config = _checked_config(config)
  if lhs_scales.shape == rhs_scales.shape == () and jnp.dtype(out_dtype) != FP8_DTYPE:
    per_tensor = PER_TENSOR_CONFIG
    if jnp.dtype(out_dtype).itemsize == 4:
      per_tensor = dataclasses.replace(per_tensor, max_concurrent_steps=_PER_TENSOR_FLOAT32_STAGES)
    run = functools.partial(kernel_call.ws_matmul, config=per_tensor, epilogue=epilogue,
                            out_dtype=out_dtype, layout=_NT)
    return refusing_gradient(
        lambda lhs, rhs, bias, scales: run(lhs, rhs, bias, column_scales=scales),
        _NOT_DIFFERENTIABLE)(lhs, rhs, bias, jnp.full((n,), lhs_scales * rhs_scales))
  lhs_scales = jnp.broadcast_to(lhs_scales, lhs_scales_shape)
  rhs_scales = jnp.broadcast_to(rhs_scales,
                                rhs_row_scales_shape if rhs_row_scales else rhs_scales_shape)
  if config is None:
    config = default_config(m, k, n, out_dtype, has_bias=bias is not None,
                            rhs_row_scales=rhs_row_scales)
  run = functools.partial(kernel_call.fp8_block_scaled_matmul, config=config, epilogue=epilogue,
                          out_dtype=out_dtype, rhs_row_scales=rhs_row_scales)
  return refusing_gradient(run, _NOT_DIFFERENTIABLE)(lhs, rhs, lhs_scales, rhs_scales, bias)


def fp8_linear(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *,
               config: Fp8Config | None = None) -> jax.Array:
  """`x @ w + bias` with all three products of training on FP8 tensor cores.

  The forward quantizes x in (1, 128) blocks and w, read transposed, in
  (128, 128) blocks, and runs `fp8_matmul`. The backward (a
  `jax.custom_vjp`), as FP8 training recipes do, quantizes the cotangent g
  too: d x = g @ w.T multiplies g in (1, 128) blocks by w quantized as
  stored, (K, N) in (128, 128) blocks; d w = x.T @ g multiplies x.T by g.T,
  both in (1, 128) blocks along M: each column of g (an output feature)
  gets scales of its own, as each row of x.T does, since a cotangent's
  columns can differ by orders of magnitude, which one scale per 128 of
  them would flush to zero. Each of x, w and g is read once for both of
  its layouts (`quantize_fp8_both_layouts`; outside `jax.grad`, the forward
  takes the one layout it needs, `quantize_fp8`), and the backward
  keeps x.T and w quantized, in e4m3, from the forward. The products run on
  `fp8_matmul`. d bias is g's column sum in float32.

  Args:
    x: (..., K) bfloat16 or float16; leading dimensions are rows (M), as a
      Dense layer's batch and sequence dimensions are.
    w: (K, N) of x's dtype.
    bias: (N,) of any float dtype, or None.
    config: `fp8_matmul`'s, for all three products; by default each
      product takes `default_config` of its own output.

  Returns:
    (..., N) array of x's dtype. The gradients have the primals' dtypes;
    their error against a float32 model is e4m3's, a few percent norm-wise
    (the tests bound it).
  """
  if x.ndim < 2:
    raise ValueError(f"x must be (..., K) with at least one row dimension, got {x.shape=}")
  if w.ndim != 2:
    raise ValueError(f"w must be 2-D (K, N), got {w.shape=}")
  rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
  operands.check_operands(rows, w)  # The bias is `fp8_matmul`'s to check.
  _checked_config(config)
  out = _make_fp8_linear(config, bias is not None)(rows, w, *(() if bias is None else (bias,)))
  return out.reshape(*x.shape[:-1], w.shape[1])


@functools.cache
def _make_fp8_linear(config: Fp8Config | None, has_bias: bool):
  def product(lhs, rhs, out_dtype, bias=None):
    """lhs @ rhs.T (+ bias) of two (values, scales) pairs quantized along
    their rows (the contraction), the LHS in (1, 128) blocks."""
    (lhs_values, lhs_scales), (rhs_values, rhs_scales) = lhs, rhs
    return fp8_matmul(lhs_values, rhs_values, lhs_scales, rhs_scales, bias,
                      out_dtype=out_dtype, config=config)

  @jax.custom_vjp
  def linear(x, w, *bias):
    return product(quantize_fp8(x, ROW_BLOCK), quantize_fp8(w, SQUARE_BLOCK, transpose=True),
                   x.dtype, *bias)

  def forward(x, w, *bias):
    # Each operand is read once for both of its layouts: the forward's, and
    # the one its backward product takes (x.T for d w, w as stored for d x),
    # which is kept in e4m3 (half the bytes of keeping x and w).
    x_rows, x_columns = quantize_fp8_both_layouts(x, ROW_BLOCK)
    w_rows, w_columns = quantize_fp8_both_layouts(w, SQUARE_BLOCK)
    return product(x_rows, w_columns, x.dtype, *bias), (x_columns, w_rows, bias)

  def backward(residuals, g):
    x_columns, w_rows, bias = residuals
    g_rows, g_columns = quantize_fp8_both_layouts(g, ROW_BLOCK)
    d_x = product(g_rows, w_rows, g.dtype)
    d_w = product(x_columns, g_columns, g.dtype)
    d_bias = tuple(jnp.sum(g.astype(jnp.float32), axis=0).astype(b.dtype) for b in bias)
    # x and w share g's dtype (`operands.check_operands`); the quantized
    # layouts vary over the mesh axes their primals do.
    return tuple(cotangent_like(ct, primal) for ct, primal
                 in zip((d_x, d_w, *d_bias), (x_columns[0], w_rows[0], *bias), strict=True))

  linear.defvjp(forward, backward)
  return linear
