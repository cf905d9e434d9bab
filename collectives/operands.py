"""Checks on the local operands every collective matmul takes, run before tracing."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pipelines import operands as matmul_operands


def check_shards(lhs, rhs, dtype, *, op: str = "the collective matmuls"
                 ) -> tuple[matmul_operands.MatmulProblem, jnp.dtype]:
  """Validates lhs (M, K) and rhs (K, N); returns (local problem, out dtype).

  Operands as for `pipelines.matmul` (float16/bfloat16, K equal); `dtype`,
  the output dtype, float16 or bfloat16 (the operand dtype when None). `op`
  names the caller in the errors.
  """
  problem = matmul_operands.check_operands(lhs, rhs)
  out_dtype = matmul_operands.check_out_dtype(dtype, problem.dtype)
  if out_dtype == jnp.float32:
    raise ValueError(f"dtype=float32 is not supported by {op}; use float16 or bfloat16")
  return problem, out_dtype


def check_reduce_scatter_operands(lhs, rhs, dtype, num_devices: int
                                  ) -> tuple[matmul_operands.MatmulProblem, jnp.dtype]:
  """Validates the matmul reduce-scatter's lhs (M, K_shard) and rhs (K_shard, N).

  As `check_shards`, and M must split into `num_devices` row blocks.
  Returns (the problem of one row block, (M / D, K_shard, N), out dtype).
  """
  problem, out_dtype = check_shards(lhs, rhs, dtype)
  if problem.m % num_devices:
    raise ValueError(f"M (lhs.shape[0])={problem.m} must be divisible by the {num_devices} "
                     f"devices of the mesh axis: each device gets M / {num_devices} rows of "
                     f"the sum; {lhs.shape=}, {rhs.shape=}")
  return dataclasses.replace(problem, m=problem.m // num_devices), out_dtype
