"""Float32 references for the matmul kernels (tests and autotuning compare to these)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pipelines.epilogue import Epilogue
from pipelines.fp8_quantize import ROW_BLOCK, dequantize_fp8, rhs_scales_block
from pipelines.operands import NN, OperandLayout


def matmul_reference(lhs, rhs, bias=None, *, epilogue: Epilogue = Epilogue(),
                     out_dtype=None, layout: OperandLayout = NN) -> jax.Array:
  """`epilogue(op(lhs) @ op(rhs) + bias)` computed in float32 at HIGHEST precision.

  Args:
    lhs: (M, K), or (K, M) with `layout.transpose_lhs`; rhs: (K, N), or (N, K)
      with `layout.transpose_rhs`; bias: (N,) or None.
    out_dtype: dtype of the result; float32 by default (the reference value).
  """
  lhs = lhs.T if layout.transpose_lhs else lhs
  rhs = rhs.T if layout.transpose_rhs else rhs
  acc = jnp.dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST)
  return epilogue.apply_to_sum(acc, bias).astype(out_dtype or jnp.float32)


def fp8_matmul_reference(lhs, rhs, lhs_scales, rhs_scales, bias=None, *,
                         epilogue: Epilogue = Epilogue()) -> jax.Array:
  """`fp8_matmul`'s product in float32 at HIGHEST precision, of the dequantized
  operands: lhs (M, K) and rhs (N, K) e4m3 with scales per (1, 128) block
  and per (128, 128) block, or (1, 128) for rhs scales of shape (N,
  ceil(K / 128)); or () for one per tensor."""
  acc = jnp.dot(dequantize_fp8(lhs, lhs_scales, ROW_BLOCK),
                dequantize_fp8(rhs, rhs_scales, rhs_scales_block(rhs.shape,
                                                                 jnp.shape(rhs_scales))).T,
                precision=jax.lax.Precision.HIGHEST)
  return epilogue.apply_to_sum(acc, bias)
