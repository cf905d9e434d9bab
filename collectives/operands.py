"""Checks on the local shards every all-gather matmul takes, run before tracing."""

from __future__ import annotations

import jax.numpy as jnp

from pipelines import operands as matmul_operands


def check_shards(lhs, rhs, dtype) -> tuple[matmul_operands.MatmulProblem, jnp.dtype]:
  """Validates lhs (M_shard, K) and rhs (K, N_shard); returns (local problem, out dtype).

  Operands as for `pipelines.matmul` (float16/bfloat16, K equal); `dtype`,
  the output dtype, float16 or bfloat16 (the operand dtype when None).
  """
  problem = matmul_operands.check_operands(lhs, rhs)
  out_dtype = matmul_operands.check_out_dtype(dtype, problem.dtype)
  if out_dtype == jnp.float32:
    raise ValueError("dtype=float32 is not supported by the all-gather matmul; use float16 or "
                     "bfloat16")
  return problem, out_dtype
