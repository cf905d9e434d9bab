"""Float32 references for the matmul kernels (tests and autotuning compare to these)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pipelines.epilogue import Epilogue
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
