"""Meshes and layouts for the all-gather matmul, shared by tests, examples and benchmarks.

The layout the kernels expect: the LHS (D * M_shard, K) sharded by rows over
the ring axis (data parallel), the RHS (K, D * N_shard) by columns (tensor
parallel), and the output (D * M_shard, D * N_shard) by columns, each
device holding every row of its columns.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

RING_AXIS = "x"
LHS_SPEC, RHS_SPEC, OUT_SPEC = P(RING_AXIS, None), P(None, RING_AXIS), P(None, RING_AXIS)


def ring_mesh(num_devices: int | None = None, devices=None) -> jax.sharding.Mesh:
  """A 1-D mesh with axis `RING_AXIS` over the first `num_devices` of `devices`
  (default: all devices of the job)."""
  devices = jax.devices() if devices is None else list(devices)
  num_devices = len(devices) if num_devices is None else num_devices
  if not 1 <= num_devices <= len(devices):
    raise ValueError(f"num_devices={num_devices} must be between 1 and the {len(devices)} "
                     "devices available")
  return jax.make_mesh((num_devices,), (RING_AXIS,), devices=devices[:num_devices])


def place_operands(lhs, rhs, mesh: jax.sharding.Mesh):
  """Puts global lhs (D * M_shard, K) and rhs (K, D * N_shard) in the ring layout.

  The operands are host values every process holds in full; each process
  places only its devices' shards, so this works in multi-process jobs too.
  """
  def place(x, spec):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

  return place(lhs, LHS_SPEC), place(rhs, RHS_SPEC)


def abstract_operands(lhs, rhs, mesh: jax.sharding.Mesh):
  """Shape-and-dtype stand-ins of global lhs and rhs in the ring layout (to trace or lower)."""
  return (jax.ShapeDtypeStruct(lhs.shape, lhs.dtype, sharding=NamedSharding(mesh, LHS_SPEC)),
          jax.ShapeDtypeStruct(rhs.shape, rhs.dtype, sharding=NamedSharding(mesh, RHS_SPEC)))


def ring_matmul_fn(fn: Callable, mesh: jax.sharding.Mesh, **kwargs) -> Callable:
  """Jitted `fn(lhs_shard, rhs_shard, RING_AXIS, **kwargs)` under `shard_map` over `mesh`.

  Takes the global operands in the ring layout and returns the global
  (D * M_shard, D * N_shard) output.
  """
  def per_device(lhs, rhs):
    return fn(lhs, rhs, RING_AXIS, **kwargs)

  # The Mosaic kernel's output is not marked as varying over the axis.
  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(LHS_SPEC, RHS_SPEC),
                               out_specs=OUT_SPEC, check_vma=False))
