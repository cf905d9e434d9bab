"""The collective matmuls from XLA collectives only: run on any backend.

`ring_all_gather_matmul` is the Mosaic kernel's schedule (`schedule.py`) with
`lax.ppermute` as the transport: the shard for step i + 1 is in flight while
step i's dot runs, which XLA's asynchronous collectives overlap on GPUs.
`all_gather_then_matmul` is the naive form (gather everything, then one dot).

Both rings tie each step's dot to the next one through `lax.optimization_barrier`
(`_in_order`). Without it XLA's GPU compiler merges the steps' dots, which share
their RHS and do not depend on each other, into one dot that waits for every
transfer: nothing was left to overlap, and on two H200s the ring took 198 us
against 164 us for all-gather + dot (docs/performance-log.md, "Why the XLA ring did
not overlap under `tools/launch`").

`xla_ring_matmul_reduce_scatter` is the reduce-scatter's ring: partial sums of
one row block travel the ring in float32, each device adding its product of
that block; `matmul_then_reduce_scatter` is its naive form (one dot, then
`lax.psum_scatter`). `xla_matmul` is the local product of the XLA paths'
backward passes, in `pipelines.matmul`'s operand layouts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from collectives import operands, reduce_scatter_schedule, schedule, topology
from pipelines import TuningConfig
from pipelines.operands import OperandLayout


def _in_order(done, next_operand):
  """(done, next_operand), with next_operand made to depend on done.

  Keeps XLA from merging the dot that produced `done` with the dot that will
  read `next_operand` (see the module docstring); the values are unchanged.
  """
  return lax.optimization_barrier((done, next_operand))


def xla_matmul(lhs: jax.Array, rhs: jax.Array, *, out_dtype, transpose_lhs: bool = False,
               transpose_rhs: bool = False) -> jax.Array:
  """`op(lhs) @ op(rhs)` with XLA's dot, float32 accumulation, operands as stored.

  The layouts are `pipelines.matmul`'s: `transpose_lhs` takes lhs stored
  (K, M), `transpose_rhs` rhs stored (N, K); the dot contracts the stored
  dimensions, so nothing is transposed first.

  An output in the operand dtype is the dot's own, as `jnp.dot` runs it:
  cuBLAS accumulates in float32 and rounds once in its epilogue, where a
  float32 output would cost twice the bytes and a conversion pass (16% at
  8192x4096x14336 bf16 on an H200). Another output dtype takes the float32
  product, so that it too is rounded once.
  """
  layout = OperandLayout(transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs)
  if jnp.dtype(out_dtype) == lhs.dtype:
    return lax.dot_general(lhs, rhs, layout.dimension_numbers)
  out = lax.dot_general(lhs, rhs, layout.dimension_numbers, preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


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
  num_devices = topology.ring_axis_size(axis_name, span_all_devices=False)
  problem, out_dtype = operands.check_shards(lhs, rhs, dtype, config)
  del config  # XLA picks its own tiling.
  device = lax.axis_index(axis_name)
  # Each device forwards to its ring predecessor, as the Mosaic kernel does.
  to_predecessor = [(d, schedule.send_target(d, num_devices)) for d in range(num_devices)]
  products = []
  held = lhs
  for step in range(num_devices):
    product = xla_matmul(held, rhs, out_dtype=out_dtype)
    if schedule.sends_at_step(step, num_devices):
      # The send does not depend on the dot, so XLA can overlap the two.
      product, held = _in_order(product, lax.ppermute(held, axis_name, to_predecessor))
    products.append(product)
  # products[i] is row block shard_at_step(device, i); one gather puts the
  # blocks in order (cheaper than updating a zeroed output block by block).
  steps = schedule.step_of_shard(device, jnp.arange(num_devices), num_devices)
  out = jnp.take(jnp.stack(products), steps, axis=0, mode="clip")
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
  return xla_matmul(gathered, rhs, out_dtype=out_dtype)


def xla_ring_matmul_reduce_scatter(lhs: jax.Array, rhs: jax.Array, axis_name, *,
                                   config: TuningConfig | None = None, dtype=None) -> jax.Array:
  """`psum_scatter(lhs @ rhs, axis_name)` as a ring of `ppermute`s of partial sums.

  At step s device d computes the partial product of row block
  `reduce_scatter_schedule.block_at_step(d, s, D)` with one dot, adds the
  partial sum its ring successor sent, and sends the sum on to its ring
  predecessor; at the last step the block is its own and the sum is final.
  Partial sums travel in float32. A step's dot does not depend on the partial
  in flight, so XLA's asynchronous collectives can overlap them on GPUs.
  Same contract as the Mosaic kernel (`ring_reduce_scatter_sm90`); `config`
  is accepted for that reason and does not change what XLA does.

  Args:
    lhs: (M, K_shard) float16 or bfloat16, this device's columns of the LHS;
      M divisible by D.
    rhs: (K_shard, N) of the same dtype, this device's rows of the RHS.
    axis_name: the mesh axis K is sharded over (D devices, any subset of the job's).
    dtype: output dtype, float16 or bfloat16; the operand dtype by default.

  Returns:
    (M / D, N) of `dtype`: row block d of the sum over devices of `lhs_i @ rhs_i`.
  """
  num_devices = topology.ring_axis_size(axis_name, span_all_devices=False)
  block, out_dtype = operands.check_reduce_scatter_operands(lhs, rhs, dtype, num_devices,
                                                            config)
  del config  # XLA picks its own tiling.
  device = lax.axis_index(axis_name)
  to_predecessor = [(d, schedule.send_target(d, num_devices)) for d in range(num_devices)]

  def lhs_block(step):
    rows = reduce_scatter_schedule.block_at_step(device, step, num_devices) * block.m
    return lax.dynamic_slice_in_dim(lhs, rows, block.m, axis=0)

  held = lhs_block(0)
  arriving = None
  for step in range(num_devices):
    partial = jnp.dot(held, rhs, preferred_element_type=jnp.float32)
    if arriving is not None:
      partial = partial + arriving
    if schedule.sends_at_step(step, num_devices):
      # The next dot waits for this partial, not for its transfer.
      partial, held = _in_order(partial, lhs_block(step + 1))
      arriving = lax.ppermute(partial, axis_name, to_predecessor)
  return partial.astype(out_dtype)


def matmul_then_reduce_scatter(lhs: jax.Array, rhs: jax.Array, axis_name, *,
                               dtype=None) -> jax.Array:
  """The naive form: one dot (float32), then `lax.psum_scatter` of the float32 product.

  lhs: (M, K_shard); rhs: (K_shard, N). Returns (M / D, N) of `dtype` (the
  operand dtype by default). The partials are reduced in float32, as the
  rings reduce them (twice the bytes of a 16-bit reduce-scatter, the same
  numerics). With NCCL and cuBLAS on GPUs this is the baseline the ring
  kernel replaces.
  """
  num_devices = topology.ring_axis_size(axis_name, span_all_devices=False)
  _, out_dtype = operands.check_reduce_scatter_operands(lhs, rhs, dtype, num_devices)
  partial = jnp.dot(lhs, rhs, preferred_element_type=jnp.float32)
  return lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True).astype(out_dtype)
