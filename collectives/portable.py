"""The all-gather matmul from XLA collectives only: runs on any backend.

`ring_all_gather_matmul` is the Mosaic kernel's schedule (`schedule.py`) with
`lax.ppermute` as the transport: the shard for step i + 1 is in flight while
step i's dot runs, which XLA's asynchronous collectives overlap on GPUs.
`all_gather_then_matmul` is the naive form (gather everything, then one dot),
the reference every test compares with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from collectives import operands, schedule, topology
from pipelines import TuningConfig


def _shard_dot(lhs, rhs, out_dtype):
  return jnp.dot(lhs, rhs, preferred_element_type=jnp.float32).astype(out_dtype)


def ring_all_gather_matmul(lhs: jax.Array, rhs: jax.Array, axis_name, *,
                           config: TuningConfig | None = None, dtype=None) -> jax.Array:
  """`all_gather(lhs, axis_name) @ rhs` as a ring of `ppermute`s overlapped with dots.

  Same contract as `ring_matmul_sm90.all_gather_lhs_matmul`, so either can
  stand in for the other; `config` (the Mosaic kernel's tiling) is accepted
  for that reason and does not change what XLA does.

  Args:
    lhs: (M_shard, K) float16 or bfloat16; rhs: (K, N_shard) of the same dtype.
    axis_name: the mesh axis the LHS is sharded over (D devices, any subset
      of the job's).
    dtype: output dtype, float16 or bfloat16; the operand dtype by default.

  Returns:
    (D * M_shard, N_shard) of `dtype`, accumulated in float32.
  """
  del config  # XLA picks its own tiling.
  num_devices = topology.ring_axis_size(axis_name, span_all_devices=False)
  problem, out_dtype = operands.check_shards(lhs, rhs, dtype)
  device = lax.axis_index(axis_name)
  # Each device forwards to its ring predecessor, as the Mosaic kernel does.
  to_predecessor = [(d, schedule.send_target(d, num_devices)) for d in range(num_devices)]
  out = jnp.zeros((num_devices, problem.m, problem.n), out_dtype)
  held = lhs
  for step in range(num_devices):
    # Issued before the dot, so the transfer can overlap it.
    arriving = (lax.ppermute(held, axis_name, to_predecessor)
                if schedule.sends_at_step(step, num_devices) else None)
    shard = schedule.shard_at_step(device, step, num_devices)
    out = lax.dynamic_update_index_in_dim(out, _shard_dot(held, rhs, out_dtype), shard, 0)
    held = arriving
  return out.reshape(num_devices * problem.m, problem.n)


def all_gather_then_matmul(lhs: jax.Array, rhs: jax.Array, axis_name, *, dtype=None) -> jax.Array:
  """The naive form: `lax.all_gather` of the LHS, then one dot (float32 accumulation).

  lhs: (M_shard, K); rhs: (K, N_shard). Returns (D * M_shard, N_shard) of
  `dtype` (the operand dtype by default). With NCCL and cuBLAS on GPUs this
  is the baseline the ring kernel is measured against.
  """
  topology.ring_axis_size(axis_name, span_all_devices=False)
  _, out_dtype = operands.check_shards(lhs, rhs, dtype)
  gathered = lax.all_gather(lhs, axis_name, axis=0, tiled=True)
  return _shard_dot(gathered, rhs, out_dtype)
