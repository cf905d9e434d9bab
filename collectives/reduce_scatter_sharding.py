"""Layouts for the matmul + reduce-scatter, shared by tests, examples and benchmarks.

The layout the ring kernel expects (`ring_reduce_scatter_sm90`): the LHS
(M, D * K_shard) sharded by columns over the ring axis and the RHS
(D * K_shard, N) by rows (K sharded, as in a row-parallel layer), and the
output (M, N) sharded by rows: device d holds row block d of the full sum.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from collectives.sharding import RING_AXIS

LHS_SPEC, RHS_SPEC, OUT_SPEC = P(None, RING_AXIS), P(RING_AXIS, None), P(RING_AXIS, None)


def place_operands(lhs, rhs, mesh: jax.sharding.Mesh):
  """Puts global lhs (M, D * K_shard) and rhs (D * K_shard, N) in the reduce-scatter layout.

  The operands are host values every process holds in full; each process
  places only its devices' shards.
  """
  def place(x, spec):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

  return place(lhs, LHS_SPEC), place(rhs, RHS_SPEC)


def abstract_operands(lhs, rhs, mesh: jax.sharding.Mesh):
  """Shape-and-dtype stand-ins of global lhs and rhs in the layout (to trace or lower)."""
  return (jax.ShapeDtypeStruct(lhs.shape, lhs.dtype, sharding=NamedSharding(mesh, LHS_SPEC)),
          jax.ShapeDtypeStruct(rhs.shape, rhs.dtype, sharding=NamedSharding(mesh, RHS_SPEC)))


def reduce_scatter_fn(fn: Callable, mesh: jax.sharding.Mesh, **kwargs) -> Callable:
  """Jitted `fn(lhs_shard, rhs_shard, RING_AXIS, **kwargs)` under `shard_map` over `mesh`.

  Takes the global operands in the layout and returns the global (M, N) sum,
  sharded by rows.
  """
  def per_device(lhs, rhs):
    return fn(lhs, rhs, RING_AXIS, **kwargs)

  # The Mosaic kernel's output is not marked as varying over the axis.
  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(LHS_SPEC, RHS_SPEC),
                               out_specs=OUT_SPEC, check_vma=False))
