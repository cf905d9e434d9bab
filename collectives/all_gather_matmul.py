"""`all_gather_matmul`: the ring kernel where it can run, an XLA path elsewhere.

The choice is made at trace time from facts of this job (backend, GPU
generation, process layout, NVSHMEM) and of the shards (whether the ring has
a config that tiles them), and logged at debug level by
`logging.getLogger("collectives")`, so a user can see which path a model took
and why. `decide_implementation` is the decision itself, a pure function of
those facts.
"""

from __future__ import annotations

import dataclasses
import enum
import logging

import jax

from collectives import operands, portable, ring_config, ring_matmul_sm90, topology
from core import interpret
from pipelines import TuningConfig, matmul
from pipelines.operands import MatmulProblem

_log = logging.getLogger("collectives")


class Implementation(enum.Enum):
  AUTO = "auto"
  MOSAIC = "mosaic"  # The ring kernel (`ring_matmul_sm90`).
  LOCAL = "local"  # One device: the plain warp-specialized matmul, nothing to gather.
  XLA_RING = "xla_ring"  # The portable twin (`portable.ring_all_gather_matmul`).
  # `lax.all_gather` of the LHS, then one dot (`portable.all_gather_then_matmul`):
  # NCCL + cuBLAS on GPUs, the baseline the ring replaces.
  XLA_ALL_GATHER = "xla_all_gather"


VALID_NAMES = tuple(i.value for i in Implementation)

# Where the Mosaic ring cannot run on GPUs, the XLA ring is not the better
# fallback: in a job of one process per GPU on two H200s (no NVSHMEM, so no
# Mosaic ring) it ran at 0.78x the speed of NCCL all-gather + one dot. Until
# a measurement says otherwise, GPUs fall back to the all-gather + dot; CPUs
# (simulated devices, where nothing is timed) to the XLA ring.
_GPU_FALLBACK_REASON = ("on GPUs the XLA ring measured 0.78x NCCL all-gather + one dot "
                        "(two H200s, one process each), so all-gather then dot")


@dataclasses.dataclass(frozen=True)
class Choice:
  """An implementation, why it was chosen, and the ring's config if it is MOSAIC."""

  implementation: Implementation
  reason: str
  config: TuningConfig | None = None


def parse_implementation(implementation: Implementation | str) -> Implementation:
  """`implementation` as an `Implementation`; ValueError listing the valid names."""
  try:
    return Implementation(implementation)
  except ValueError:
    raise ValueError(f"implementation={implementation!r} is not one of {VALID_NAMES}") from None


def _fallback(reason: str, *, on_gpu: bool) -> Choice:
  if on_gpu:
    return Choice(Implementation.XLA_ALL_GATHER, f"{reason}; {_GPU_FALLBACK_REASON}")
  return Choice(Implementation.XLA_RING, reason)


def decide_implementation(requested: Implementation | str, *, num_devices: int,
                          support: topology.RingSupport, on_gpu: bool,
                          problem: MatmulProblem | None, out_dtype=None,
                          config: TuningConfig | None = None) -> Choice:
  """Which implementation runs, from the facts alone (no tracing, no devices touched).

  Args:
    requested: an `Implementation` or its name.
    num_devices: devices on the mesh axis.
    support: whether the Mosaic ring can run here (`topology.mosaic_ring_support`).
    on_gpu: whether the devices are GPUs (picks the fallback, see above).
    problem, out_dtype: the local shard problem (M_shard, K, N_shard) and the
      output dtype; without a problem, shards are assumed to tile (for labels).
    config: the caller's ring config, or None for `ring_config.default_ring_config`.

  Returns:
    The `Choice`. "auto" never fails for valid shards: where the ring cannot
    run them it falls back and says why.

  Raises:
    ValueError: an unknown name, or "local" over more than one device.
    NotImplementedError: "mosaic" for shards no ring config tiles.
  """
  requested = parse_implementation(requested)
  if requested == Implementation.LOCAL:
    if num_devices != 1:
      raise ValueError(f"implementation='local' runs the plain matmul on one device, but the "
                       f"mesh axis has {num_devices} devices; use one of "
                       f"{[n for n in VALID_NAMES if n != 'local']}")
    return Choice(requested, "requested")
  if requested in (Implementation.XLA_RING, Implementation.XLA_ALL_GATHER):
    return Choice(requested, "requested")
  if requested == Implementation.AUTO and not support.supported:
    return _fallback(support.reason, on_gpu=on_gpu)
  if num_devices == 1:
    return Choice(Implementation.LOCAL, "one device: no ring, the warp-specialized matmul alone")
  reason = support.reason if requested == Implementation.AUTO else "requested"
  if problem is None:
    return Choice(Implementation.MOSAIC, reason, config)
  if config is None:
    config = ring_config.default_ring_config(problem, out_dtype)
    if config is None:
      why = (f"no CTA tile the ring can run divides M_shard={problem.m} and "
             f"N_shard={problem.n} (K={problem.k}) and fits SMEM")
      if requested == Implementation.MOSAIC:
        raise NotImplementedError(f"implementation='mosaic': {why}; pass a config, or use "
                                  "implementation='auto', which falls back to XLA")
      return _fallback(why, on_gpu=on_gpu)
  elif requested == Implementation.AUTO:
    try:
      ring_matmul_sm90.check_ring_config(config, problem, out_dtype)
    except ValueError as e:
      return _fallback(f"the ring cannot run the given config: {e}", on_gpu=on_gpu)
  # "mosaic" with a config it cannot run is refused by the kernel's own check.
  return Choice(Implementation.MOSAIC, reason, config)


def choose_implementation(num_devices: int, requested: Implementation | str = Implementation.AUTO,
                          *, problem: MatmulProblem | None = None, out_dtype=None,
                          config: TuningConfig | None = None) -> Choice:
  """Which implementation `all_gather_matmul` runs over `num_devices` devices, and why.

  `decide_implementation` with this job's facts; see there for the arguments.
  """
  return decide_implementation(requested, num_devices=num_devices,
                               support=topology.mosaic_ring_support(num_devices),
                               on_gpu=jax.default_backend() == "gpu", problem=problem,
                               out_dtype=out_dtype, config=config)


def _check_interpreter_runs_the_ring(num_devices: int) -> None:
  """Raises NotImplementedError where interpret mode cannot run the ring over `num_devices`.

  jax's GPU interpreter has neither semaphores nor peer memory; across
  simulated devices the ring kernel runs only on the simulator's extension of
  it, which tests install. Without it the kernel would fail only when it runs,
  deep inside jax.
  """
  if (num_devices > 1 and interpret.is_interpreting()
      and not interpret.can_interpret_collectives()):
    raise NotImplementedError(
        "the ring kernel on simulated devices needs semaphores and peer memory in interpret "
        "mode: run it inside simulator.collective_interpret_mode()")


def all_gather_matmul(lhs: jax.Array, rhs: jax.Array, axis_name, *,
                      config: TuningConfig | None = None, dtype=None,
                      implementation: Implementation | str = Implementation.AUTO) -> jax.Array:
  """`all_gather(lhs, axis_name) @ rhs`, overlapping the gather with the matmul; inside `shard_map`.

  Args:
    lhs: (M_shard, K) float16 or bfloat16, this device's rows.
    rhs: (K, N_shard) of the same dtype, this device's columns.
    axis_name: the mesh axis the LHS is sharded over (D devices); the Mosaic
      kernel needs it to span all devices of the job.
    config: the ring kernel's matmul config; by default
      `ring_config.default_ring_config` for the local (M_shard, K, N_shard)
      problem: cooperative, no split K, a CTA tile that divides the shards
      (on one device, the plain matmul's tuning cache and heuristic).
    dtype: output dtype, float16 or bfloat16; the operand dtype by default.
    implementation: "auto", or one of "mosaic" (the ring kernel), "local"
      (one device only: the plain matmul), "xla_ring" (the ring of
      `ppermute`s) and "xla_all_gather" (`lax.all_gather`, then one dot) to
      force it. "auto" takes the Mosaic ring on Hopper GPUs that reach each
      other's memory when it has a config that tiles the shards; otherwise the
      all-gather + dot on GPUs and the XLA ring elsewhere, and logs why. Only
      "mosaic" raises NotImplementedError where it cannot run.

  Returns:
    (D * M_shard, N_shard) of `dtype`; row block j is `lhs_j @ rhs`.
  """
  num_devices = topology.ring_axis_size(axis_name, span_all_devices=False)
  problem, out_dtype = operands.check_shards(lhs, rhs, dtype)
  choice = choose_implementation(num_devices, implementation, problem=problem,
                                 out_dtype=out_dtype, config=config)
  _log.debug("all_gather_matmul over %d devices of %s: %s (%s)", num_devices, axis_name,
             choice.implementation.value, choice.reason)
  match choice.implementation:
    case Implementation.XLA_RING:
      return portable.ring_all_gather_matmul(lhs, rhs, axis_name, config=config,
                                             dtype=out_dtype)
    case Implementation.XLA_ALL_GATHER:
      return portable.all_gather_then_matmul(lhs, rhs, axis_name, dtype=out_dtype)
    case Implementation.LOCAL:
      return matmul(lhs, rhs, config=config, out_dtype=out_dtype)
    case _:
      _check_interpreter_runs_the_ring(num_devices)
      return ring_matmul_sm90.all_gather_lhs_matmul(lhs, rhs, axis_name, config=choice.config,
                                                    dtype=out_dtype)
