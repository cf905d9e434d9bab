"""Checks on the local operands every collective matmul takes, run before tracing."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pipelines import operands as matmul_operands
from pipelines.config import check_tuning_config


def check_shards(lhs, rhs, dtype, config=None, *, op: str = "the collective matmuls"
                 ) -> tuple[matmul_operands.MatmulProblem, jnp.dtype]:
  """Validates lhs (M, K) and rhs (K, N); returns (local problem, out dtype).

  Operands as for `pipelines.matmul` (float16/bfloat16, K equal); `dtype`,
  the output dtype, float16 or bfloat16 (the operand dtype when None);
  `config`, None or a `TuningConfig` (the XLA forms accept and ignore one).
  `op` names the caller in the errors.
  """
  if config is not None:
    check_tuning_config(config)
  problem = matmul_operands.check_operands(lhs, rhs)
  out_dtype = jnp.dtype(problem.dtype if dtype is None else dtype)
  if out_dtype not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"dtype={out_dtype.name} is not supported by {op} as the output "
                     "dtype; use float16 or bfloat16")
  return problem, out_dtype


def check_reduce_scatter_operands(lhs, rhs, dtype, num_devices: int, config=None
                                  ) -> tuple[matmul_operands.MatmulProblem, jnp.dtype]:
  """Validates the matmul reduce-scatter's lhs (M, K_shard) and rhs (K_shard, N).

  As `check_shards`, and M must split into `num_devices` row blocks.
  Returns (the problem of one row block, (M / D, K_shard, N), out dtype).
  """
  problem, out_dtype = check_shards(lhs, rhs, dtype, config)
  if problem.m % num_devices:
    raise ValueError(f"M (lhs.shape[0])={problem.m} must be divisible by the {num_devices} "
                     f"devices of the mesh axis: each device gets M / {num_devices} rows of "
                     f"the sum; {lhs.shape=}, {rhs.shape=}")
  return dataclasses.replace(problem, m=problem.m // num_devices), out_dtype
