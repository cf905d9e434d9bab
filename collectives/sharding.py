"""Meshes and layouts for the collective matmuls, shared by tests, examples and benchmarks.

The all-gather matmul's layout (`ALL_GATHER`): the LHS (D * M_shard, K)
sharded by rows over the ring axis (data parallel), the RHS (K, D * N_shard)
by columns (tensor parallel), and the output (D * M_shard, D * N_shard) by
columns, each device holding every row of its columns.

The matmul reduce-scatter's (`REDUCE_SCATTER`): the LHS (M, D * K_shard) by
columns, the RHS (D * K_shard, N) by rows, and the output (M, N) by rows,
each device holding M / D rows of the sum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

RING_AXIS = "x"
LHS_SPEC, RHS_SPEC, OUT_SPEC = P(RING_AXIS, None), P(None, RING_AXIS), P(None, RING_AXIS)


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the global lhs, rhs and output of a collective matmul are sharded."""

  lhs: P
  rhs: P
  out: P


ALL_GATHER = Layout(LHS_SPEC, RHS_SPEC, OUT_SPEC)
REDUCE_SCATTER = Layout(P(None, RING_AXIS), P(RING_AXIS, None), P(RING_AXIS, None))


def ring_mesh(num_devices: int | None = None, devices=None) -> jax.sharding.Mesh:
  """A 1-D mesh with axis `RING_AXIS` over the first `num_devices` of `devices`
  (default: all devices of the job)."""
  devices = jax.devices() if devices is None else list(devices)
  num_devices = len(devices) if num_devices is None else num_devices
  if not 1 <= num_devices <= len(devices):
    raise ValueError(f"num_devices={num_devices} must be between 1 and the {len(devices)} "
                     "devices available")
  return jax.make_mesh((num_devices,), (RING_AXIS,), devices=devices[:num_devices])


def abstract_ring_mesh(num_devices: int) -> jax.sharding.AbstractMesh:
  """A 1-D mesh of `num_devices` along `RING_AXIS` with no devices behind it: enough to
  trace or validate a ring (`abstract_operands`) on a job of any size, one device too."""
  if num_devices < 1:
    raise ValueError(f"num_devices={num_devices} must be at least 1")
  return jax.sharding.AbstractMesh((num_devices,), (RING_AXIS,))


def place_operands(lhs, rhs, mesh: jax.sharding.Mesh, layout: Layout = ALL_GATHER):
  """Puts global lhs and rhs in `layout` (by default the all-gather's: lhs
  (D * M_shard, K), rhs (K, D * N_shard)).

  The operands are host values every process holds in full; each process
  places only its devices' shards, so this works in multi-process jobs too.
  """
  def place(x, spec):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

  return place(lhs, layout.lhs), place(rhs, layout.rhs)


def abstract_operands(lhs, rhs, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
                      layout: Layout = ALL_GATHER):
  """Shape-and-dtype stand-ins of global lhs and rhs in `layout` (to trace or lower)."""
  return (jax.ShapeDtypeStruct(lhs.shape, lhs.dtype, sharding=NamedSharding(mesh, layout.lhs)),
          jax.ShapeDtypeStruct(rhs.shape, rhs.dtype, sharding=NamedSharding(mesh, layout.rhs)))


def ring_matmul_fn(fn: Callable, mesh: jax.sharding.Mesh, *, layout: Layout = ALL_GATHER,
                   **kwargs) -> Callable:
  """Jitted `fn(lhs_shard, rhs_shard, RING_AXIS, **kwargs)` under `shard_map` over `mesh`.

  Takes the global operands in `layout` and returns the global output
  ((D * M_shard, D * N_shard) for the all-gather, (M, N) for the reduce-scatter).
  """
  def per_device(lhs, rhs):
    return fn(lhs, rhs, RING_AXIS, **kwargs)

  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(layout.lhs, layout.rhs),
                               out_specs=layout.out))
