"""`all_gather_matmul`: the ring kernel where it can run, the XLA ring elsewhere.

The choice is made at trace time from facts of this job (backend, GPU
generation, process layout, NVSHMEM) and logged at debug level by
`logging.getLogger("collectives")`, so a user can see which path a model took.
"""

from __future__ import annotations

import dataclasses
import enum
import logging

import jax

from collectives import operands, portable, ring_matmul_sm90, topology
from pipelines import TuningConfig, default_config, matmul

_log = logging.getLogger("collectives")


class Implementation(enum.Enum):
  AUTO = "auto"
  MOSAIC = "mosaic"  # The ring kernel (`ring_matmul_sm90`).
  LOCAL = "local"  # One device: the plain warp-specialized matmul, nothing to gather.
  XLA_RING = "xla_ring"  # The portable twin (`portable.ring_all_gather_matmul`).


@dataclasses.dataclass(frozen=True)
class Choice:
  implementation: Implementation
  reason: str


def choose_implementation(num_devices: int, requested: Implementation = Implementation.AUTO
                          ) -> Choice:
  """Which implementation `all_gather_matmul` runs over `num_devices` devices, and why."""
  requested = Implementation(requested)
  if requested == Implementation.XLA_RING:
    return Choice(requested, "requested")
  support = topology.mosaic_ring_support(num_devices)
  if requested == Implementation.AUTO and not support.supported:
    return Choice(Implementation.XLA_RING, support.reason)
  if num_devices == 1:
    return Choice(Implementation.LOCAL, "one device: no ring, the warp-specialized matmul alone")
  return Choice(Implementation.MOSAIC, support.reason if support.supported else "requested")


def all_gather_matmul(lhs: jax.Array, rhs: jax.Array, axis_name, *,
                      config: TuningConfig | None = None, dtype=None,
                      implementation: Implementation | str = Implementation.AUTO) -> jax.Array:
  """`all_gather(lhs, axis_name) @ rhs`, overlapping the gather with the matmul; inside `shard_map`.

  Args:
    lhs: (M_shard, K) float16 or bfloat16, this device's rows.
    rhs: (K, N_shard) of the same dtype, this device's columns.
    axis_name: the mesh axis the LHS is sharded over (D devices); the Mosaic
      kernel needs it to span all devices of the job.
    config: the ring kernel's matmul config; by default the warp-specialized
      matmul's heuristic for the local (M_shard, K, N_shard) problem, limited
      to configs the ring can run: cooperative, no split K, CTA tiles that
      divide the shards (on one device, its tuning cache first).
    dtype: output dtype, float16 or bfloat16; the operand dtype by default.
    implementation: "auto" (the Mosaic ring on Hopper GPUs that can reach
      each other's memory, the XLA ring elsewhere), or "mosaic" / "xla_ring"
      to force one. "mosaic" raises NotImplementedError where it cannot run.

  Returns:
    (D * M_shard, N_shard) of `dtype`; row block j is `lhs_j @ rhs`.
  """
  num_devices = topology.ring_axis_size(axis_name, span_all_devices=False)
  problem, out_dtype = operands.check_shards(lhs, rhs, dtype)
  choice = choose_implementation(num_devices, implementation)
  _log.debug("all_gather_matmul over %d devices of %s: %s (%s)", num_devices, axis_name,
             choice.implementation.value, choice.reason)
  if choice.implementation == Implementation.XLA_RING:
    return portable.ring_all_gather_matmul(lhs, rhs, axis_name, config=config, dtype=out_dtype)
  if choice.implementation == Implementation.LOCAL:
    return matmul(lhs, rhs, config=config, out_dtype=out_dtype)
  if config is None:
    config = default_config(problem, out_dtype, forwards_lhs_tiles=True)
  return ring_matmul_sm90.all_gather_lhs_matmul(lhs, rhs, axis_name, config=config,
                                                dtype=out_dtype)
