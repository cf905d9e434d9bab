"""The choice every collective matmul makes: its Mosaic ring kernel where it can run, XLA elsewhere.

`decide` is the decision itself, a pure function of the facts of the job
(backend, whether the ring kernel can run here) and of the local problem
(whether the kernel has a config for it), for one collective matmul described
by a `RingOp`. The ops' modules (`all_gather_matmul.py`,
`matmul_reduce_scatter.py`) gather the facts and log the choice.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import jax

from collectives import topology
from core import interpret
from pipelines import TuningConfig
from pipelines.operands import MatmulProblem


class Implementation(enum.Enum):
  AUTO = "auto"
  MOSAIC = "mosaic"  # The op's Mosaic ring kernel.
  LOCAL = "local"  # One device: the plain warp-specialized matmul, nothing to communicate.
  XLA_RING = "xla_ring"  # The portable twin: a ring of `lax.ppermute`s and dots.
  # `lax.all_gather` of the LHS, then one dot: all_gather_matmul's naive form
  # (NCCL + cuBLAS on GPUs), the baseline its ring replaces.
  XLA_ALL_GATHER = "xla_all_gather"
  # One dot, then `lax.psum_scatter`: matmul_reduce_scatter's naive form.
  XLA_REDUCE_SCATTER = "xla_reduce_scatter"


@dataclasses.dataclass(frozen=True)
class Choice:
  """An implementation, why it was chosen, and the ring's config if it is MOSAIC."""

  implementation: Implementation
  reason: str
  config: TuningConfig | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingOp:
  """What the decision needs to know of one collective matmul.

  Attributes:
    name: the public function's name, for messages.
    naive: its naive XLA form, the fallback on GPUs.
    gpu_fallback_reason: why GPUs fall back to `naive` rather than the XLA ring.
    default_config: (local problem, out dtype) -> a config the Mosaic kernel
      can run, or None. May raise NotImplementedError where the kernel is
      missing (only "mosaic" asks it then: "auto" has been told by `support`).
    no_config_reason: (local problem) -> why there is no config, for messages.
    check_config: raises ValueError for a caller's config the kernel cannot
      run, so that "auto" can fall back; None where only the kernel checks.
  """

  name: str
  naive: Implementation
  gpu_fallback_reason: str
  default_config: Callable[[MatmulProblem, object], TuningConfig | None]
  no_config_reason: Callable[[MatmulProblem], str]
  check_config: Callable[[TuningConfig, MatmulProblem, object], None] | None = None

  @property
  def valid_names(self) -> tuple[str, ...]:
    return tuple(i.value for i in Implementation
                 if i not in (Implementation.XLA_ALL_GATHER, Implementation.XLA_REDUCE_SCATTER)
                 or i == self.naive)

  def parse(self, implementation: Implementation | str) -> Implementation:
    """`implementation` as an `Implementation`; ValueError listing the valid names."""
    try:
      parsed = Implementation(implementation)
    except ValueError:
      parsed = None
    if parsed is None or parsed.value not in self.valid_names:
      raise ValueError(f"implementation={implementation!r} is not one of {self.valid_names}")
    return parsed


def _fallback(op: RingOp, reason: str, *, on_gpu: bool) -> Choice:
  if on_gpu:
    return Choice(op.naive, f"{reason}; {op.gpu_fallback_reason}")
  return Choice(Implementation.XLA_RING, reason)


def decide(op: RingOp, requested: Implementation | str, *, num_devices: int,
           support: topology.RingSupport, on_gpu: bool, problem: MatmulProblem | None,
           out_dtype=None, config: TuningConfig | None = None) -> Choice:
  """Which implementation of `op` runs, from the facts alone (no tracing, no devices touched).

  Args:
    op: the collective matmul.
    requested: an `Implementation` or its name.
    num_devices: devices on the mesh axis.
    support: whether the Mosaic ring kernel can run here.
    on_gpu: whether the devices are GPUs (picks the fallback).
    problem, out_dtype: the local problem the kernel's config is for, and the
      output dtype; without a problem, it is assumed to tile (for labels).
    config: the caller's ring config, or None for `op.default_config`.

  Returns:
    The `Choice`. "auto" never fails for valid operands: where the ring cannot
    run them it falls back and says why.

  Raises:
    ValueError: an unknown name, or "local" over more than one device.
    NotImplementedError: "mosaic" for a problem the kernel has no config for,
      or where the kernel is missing.
  """
  requested = op.parse(requested)
  if requested == Implementation.LOCAL:
    if num_devices != 1:
      raise ValueError(f"implementation='local' runs the plain matmul on one device, but the "
                       f"mesh axis has {num_devices} devices; use one of "
                       f"{[n for n in op.valid_names if n != 'local']}")
    return Choice(requested, "requested")
  if requested in (Implementation.XLA_RING, op.naive):
    return Choice(requested, "requested")
  if requested == Implementation.AUTO and not support.supported:
    return _fallback(op, support.reason, on_gpu=on_gpu)
  if num_devices == 1:
    return Choice(Implementation.LOCAL, "one device: no ring, the warp-specialized matmul alone")
  reason = support.reason if requested == Implementation.AUTO else "requested"
  if problem is None:
    return Choice(Implementation.MOSAIC, reason, config)
  if config is None:
    config = op.default_config(problem, out_dtype)
    if config is None:
      why = op.no_config_reason(problem)
      if requested == Implementation.MOSAIC:
        raise NotImplementedError(f"implementation='mosaic': {why}; pass a config, or use "
                                  "implementation='auto', which falls back to XLA")
      return _fallback(op, why, on_gpu=on_gpu)
  elif requested == Implementation.AUTO and op.check_config is not None:
    try:
      op.check_config(config, problem, out_dtype)
    except ValueError as e:
      return _fallback(op, f"the ring cannot run the given config: {e}", on_gpu=on_gpu)
  # "mosaic" with a config it cannot run is refused by the kernel's own check.
  return Choice(Implementation.MOSAIC, reason, config)


def choose(op: RingOp, num_devices: int, requested: Implementation | str, *,
           problem: MatmulProblem | None, out_dtype=None,
           config: TuningConfig | None = None) -> Choice:
  """`decide` with this job's facts: whether the Mosaic ring can run over
  `num_devices` devices here, and whether they are GPUs."""
  return decide(op, requested, num_devices=num_devices,
                support=topology.mosaic_ring_support(num_devices),
                on_gpu=jax.default_backend() == "gpu", problem=problem, out_dtype=out_dtype,
                config=config)


def check_interpreter_runs_the_ring(num_devices: int) -> None:
  """Raises NotImplementedError where interpret mode cannot run a ring kernel over `num_devices`.

  jax's GPU interpreter has neither semaphores nor peer memory; across
  simulated devices the ring kernels run only on the simulator's extension of
  it, which tests install. Without it a kernel would fail only when it runs,
  deep inside jax.
  """
  if (num_devices > 1 and interpret.is_interpreting()
      and not interpret.can_interpret_collectives()):
    raise NotImplementedError(
        "the ring kernel on simulated devices needs semaphores and peer memory in interpret "
        "mode: run it inside simulator.collective_interpret_mode()")
