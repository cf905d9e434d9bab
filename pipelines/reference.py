"""Float32 references for the matmul kernels (tests and autotuning compare to these)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pipelines.epilogue import Epilogue


def matmul_reference(lhs, rhs, bias=None, *, epilogue: Epilogue = Epilogue(),
                     out_dtype=None) -> jax.Array:
  """`epilogue(lhs @ rhs + bias)` computed in float32 at HIGHEST precision.

  Args:
    lhs: (M, K); rhs: (K, N); bias: (N,) or None.
    out_dtype: dtype of the result; float32 by default (the reference value).
  """
  acc = jnp.dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST)
  return epilogue.apply_to_sum(acc, bias).astype(out_dtype or jnp.float32)
