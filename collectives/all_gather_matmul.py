"""Which implementation of `all_gather_matmul` runs, and its forward product.

The choice is made at trace time from facts of this job (backend, GPU
generation, process layout, NVSHMEM) and of the shards (whether the ring has
a config that tiles them), by `dispatch.decide`; `decide_implementation` is
that decision for this op, a pure function of the facts. The public,
differentiable `all_gather_matmul` (validation, the logged choice, the
custom VJP) is in `api.py`.
"""

from __future__ import annotations

import jax

from collectives import dispatch, portable, ring_config, ring_matmul_sm90, topology
from collectives.dispatch import Choice, Implementation
from pipelines import TuningConfig, matmul
from pipelines.operands import MatmulProblem

__all__ = ["OP", "VALID_NAMES", "Choice", "Implementation", "choose_implementation",
           "decide_implementation", "forward", "parse_implementation"]

# Where the Mosaic ring cannot run on GPUs, the XLA ring is not the better
# fallback: in a job of one process per GPU on two H200s (no NVSHMEM, so no
# Mosaic ring) it ran at 0.78x the speed of NCCL all-gather + one dot. Until
# a measurement says otherwise, GPUs fall back to the all-gather + dot; CPUs
# (simulated devices, where nothing is timed) to the XLA ring.
_GPU_FALLBACK_REASON = ("on GPUs the XLA ring measured 0.78x NCCL all-gather + one dot "
                        "(two H200s, one process each), so all-gather then dot")


def _no_config_reason(problem: MatmulProblem) -> str:
  return (f"no CTA tile the ring can run divides M_shard={problem.m} and "
          f"N_shard={problem.n} (K={problem.k}) and fits SMEM")


OP = dispatch.RingOp(
    name="all_gather_matmul",
    naive=Implementation.XLA_ALL_GATHER,
    gpu_fallback_reason=_GPU_FALLBACK_REASON,
    default_config=ring_config.default_ring_config,
    no_config_reason=_no_config_reason,
    check_config=ring_matmul_sm90.check_ring_config,
)
VALID_NAMES = OP.valid_names


def parse_implementation(implementation: Implementation | str) -> Implementation:
  """`implementation` as an `Implementation`; ValueError listing the valid names."""
  return OP.parse(implementation)


def decide_implementation(requested: Implementation | str, *, num_devices: int,
                          support: topology.RingSupport, on_gpu: bool,
                          problem: MatmulProblem | None, out_dtype=None,
                          config: TuningConfig | None = None) -> Choice:
  """Which implementation runs, from the facts alone: `dispatch.decide` for this op.

  `problem` is the local shard problem (M_shard, K, N_shard); `support`
  whether the Mosaic ring can run here (`topology.mosaic_ring_support`);
  `config` the caller's ring config, or None for
  `ring_config.default_ring_config`. "auto" never fails for valid shards;
  "mosaic" raises NotImplementedError for shards no ring config tiles.
  """
  return dispatch.decide(OP, requested, num_devices=num_devices, support=support,
                         on_gpu=on_gpu, problem=problem, out_dtype=out_dtype, config=config)


def choose_implementation(num_devices: int, requested: Implementation | str = Implementation.AUTO,
                          *, problem: MatmulProblem | None = None, out_dtype=None,
                          config: TuningConfig | None = None) -> Choice:
  """Which implementation `all_gather_matmul` runs over `num_devices` devices, and why.

  `decide_implementation` with this job's facts; see there for the arguments.
  """
  return dispatch.choose(OP, num_devices, requested, problem=problem, out_dtype=out_dtype,
                         config=config)


def forward(choice: Choice, lhs: jax.Array, rhs: jax.Array, axis_name, *, num_devices: int,
            config: TuningConfig | None, out_dtype) -> jax.Array:
  """Runs the chosen implementation on validated shards (no gradient rule of its own)."""
  match choice.implementation:
    case Implementation.XLA_RING:
      return portable.ring_all_gather_matmul(lhs, rhs, axis_name, config=config,
                                             dtype=out_dtype)
    case Implementation.XLA_ALL_GATHER:
      return portable.all_gather_then_matmul(lhs, rhs, axis_name, dtype=out_dtype)
    case Implementation.LOCAL:
      return matmul(lhs, rhs, config=config, out_dtype=out_dtype)
    case _:
      dispatch.check_interpreter_runs_the_ring(num_devices)
      return ring_matmul_sm90.all_gather_lhs_matmul(lhs, rhs, axis_name, config=choice.config,
                                                    dtype=out_dtype)
