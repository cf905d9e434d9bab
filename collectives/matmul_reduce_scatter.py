"""Which implementation of `matmul_reduce_scatter` runs, and its forward product.

The Mosaic kernel (`ring_reduce_scatter_sm90`) is reached through
`ring_kernel()`, the one place tests replace it:

    ring_matmul_reduce_scatter(lhs, rhs, axis_name, *, config, dtype=None) -> jax.Array
    ring_reduce_scatter_config(problem, out_dtype) -> TuningConfig | None

the first as `portable.xla_ring_matmul_reduce_scatter`, the second a config
the kernel can run on the problem of one row block, (M / D, K_shard, N), or
None. Where the ring cannot run, "auto" falls back (on GPUs to the naive
form, NCCL reduce-scatter + one dot, as `all_gather_matmul` does; elsewhere
to the XLA ring) and "mosaic" refuses. The public, differentiable
`matmul_reduce_scatter` is in `api.py`.
"""

from __future__ import annotations

import jax

from collectives import dispatch, portable, ring_reduce_scatter_sm90, topology
from collectives.dispatch import Choice, Implementation
from pipelines import TuningConfig, matmul
from pipelines.operands import MatmulProblem

# Not measured yet: the all-gather's XLA ring measured 0.78x NCCL all-gather +
# one dot on two H200s (all_gather_matmul.py), and this ring sends float32
# partials, twice a 16-bit shard's bytes. Until a measurement says otherwise,
# GPUs fall back to the naive form.
_GPU_FALLBACK_REASON = ("on GPUs the naive form (NCCL reduce-scatter + one dot), as for the "
                        "all-gather, where the XLA ring measured 0.78x NCCL")


def ring_kernel():
  """The Mosaic reduce-scatter ring kernel's module (see the module docstring)."""
  return ring_reduce_scatter_sm90


def default_ring_config(problem: MatmulProblem, out_dtype) -> TuningConfig | None:
  """The kernel's config for the row-block problem (M / D, K_shard, N), or None."""
  return ring_kernel().ring_reduce_scatter_config(problem, out_dtype)


def check_ring_config(config: TuningConfig, problem: MatmulProblem, out_dtype) -> None:
  """Raises ValueError unless the kernel can run `config` on the row-block problem; "auto"
  then falls back from a caller's config instead of failing in the kernel."""
  ring_kernel().check_reduce_scatter_config(config, problem, out_dtype)


def _no_config_reason(problem: MatmulProblem) -> str:
  return (f"the reduce-scatter ring has no config for row blocks of M / D={problem.m} rows, "
          f"K_shard={problem.k}, N={problem.n}")


OP = dispatch.RingOp(
    name="matmul_reduce_scatter",
    naive=Implementation.XLA_REDUCE_SCATTER,
    gpu_fallback_reason=_GPU_FALLBACK_REASON,
    default_config=default_ring_config,
    no_config_reason=_no_config_reason,
    check_config=check_ring_config,
)
VALID_NAMES = OP.valid_names


def decide_implementation(requested: Implementation | str, *, num_devices: int,
                          support: topology.RingSupport, on_gpu: bool,
                          problem: MatmulProblem | None, out_dtype=None,
                          config: TuningConfig | None = None) -> Choice:
  """`dispatch.decide` for this op; `problem` is one row block's, (M / D, K_shard, N)."""
  return dispatch.decide(OP, requested, num_devices=num_devices, support=support,
                         on_gpu=on_gpu, problem=problem, out_dtype=out_dtype, config=config)


def choose_implementation(num_devices: int, requested: Implementation | str = Implementation.AUTO,
                          *, problem: MatmulProblem | None = None, out_dtype=None,
                          config: TuningConfig | None = None) -> Choice:
  """Which implementation `matmul_reduce_scatter` runs over `num_devices` devices, and why."""
  return dispatch.choose(OP, num_devices, requested, problem=problem, out_dtype=out_dtype,
                         config=config)


def forward(choice: Choice, lhs: jax.Array, rhs: jax.Array, axis_name, *, num_devices: int,
            config: TuningConfig | None, out_dtype) -> jax.Array:
  """Runs the chosen implementation on validated operands (no gradient rule of its own)."""
  match choice.implementation:
    case Implementation.XLA_RING:
      return portable.xla_ring_matmul_reduce_scatter(lhs, rhs, axis_name, config=config,
                                                     dtype=out_dtype)
    case Implementation.XLA_REDUCE_SCATTER:
      return portable.matmul_then_reduce_scatter(lhs, rhs, axis_name, dtype=out_dtype)
    case Implementation.LOCAL:
      return matmul(lhs, rhs, config=config, out_dtype=out_dtype)
    case _:
      kernel = ring_kernel()
      dispatch.check_interpreter_runs_the_ring(num_devices)
      return kernel.ring_matmul_reduce_scatter(lhs, rhs, axis_name, config=choice.config,
                                               dtype=out_dtype)
