"""A config sweep for the warp-specialized matmul.

Candidates the SMEM budget rejects, or that do not fit the problem, are
skipped without compiling. Each survivor is compiled, checked against the
float32 reference (a config that computes wrong numbers never wins) and timed;
the winner can be stored in the tuning cache that `matmul()` reads. A sweep in
which nothing passes raises `TuningError` rather than return a loser.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import pathlib
import sys
from collections.abc import Callable, Iterable, Sequence

import jax

from core import timing
from core.numerics import RELATIVE_TOLERANCE, relative_error_on_device
from pipelines import kernel_call, operands, tuning_cache
from pipelines.config import MatmulDimension, Schedule, TuningConfig
from pipelines.heuristic import default_config
from pipelines.reference import matmul_reference

_log = logging.getLogger(__name__)
_REASON_CHARS = 300  # Of a rejection's reason: enough for an error's first lines.


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchSpace:
  """The values each `TuningConfig` field takes in a sweep."""

  tile_m: tuple[int, ...] = (64, 128)
  tile_n: tuple[int, ...] = (128, 192, 256)
  tile_k: tuple[int, ...] = (64,)
  max_concurrent_steps: tuple[int, ...] = (3, 4, 5, 6)
  epi_tile: tuple[tuple[int, int], ...] = ((64, 64), (64, 128))
  grid_minor_dim: tuple[MatmulDimension, ...] = tuple(MatmulDimension)
  grid_tile_width: tuple[int, ...] = (4, 8, 16)
  wg_dimension: tuple[MatmulDimension, ...] = tuple(MatmulDimension)
  schedule: tuple[Schedule, ...] = tuple(Schedule)
  # Split-K pays only where the output tiles leave SMs idle; sweep it there.
  k_splits: tuple[int, ...] = (1,)
  # One-segment RHS tiles multicast to 2-CTA clusters pay where a (K, N) RHS
  # with a ragged N would be padded (`TuningConfig.rhs_tile_n`, `cluster_m`).
  rhs_tile_n: tuple[int | None, ...] = (None,)
  cluster_m: tuple[int, ...] = (1,)
  # One ring of slots across a block's tiles (`TuningConfig.chain_tiles`):
  # not timed against the default yet, so swept only where asked for.
  chain_tiles: tuple[bool, ...] = (False,)

  def __post_init__(self):
    for field in dataclasses.fields(self):
      values = getattr(self, field.name)
      if not isinstance(values, (tuple, list)) or not values:
        raise ValueError(f"SearchSpace.{field.name} must be a non-empty tuple of the values to "
                         f"sweep, got {values!r}")

  def configs(self) -> Iterable[TuningConfig]:
    seen = set()
    for (tm, tn, tk, steps, (em, en), minor, width, wgd, schedule, splits, rhs_tile_n,
         cluster_m, chain_tiles) in itertools.product(
        self.tile_m, self.tile_n, self.tile_k, self.max_concurrent_steps, self.epi_tile,
        self.grid_minor_dim, self.grid_tile_width, self.wg_dimension, self.schedule,
        self.k_splits, self.rhs_tile_n, self.cluster_m, self.chain_tiles):
      if schedule == Schedule.PINGPONG:
        wgd = MatmulDimension.N  # No split under ping-pong: one config, not two.
      try:
        config = TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=steps,
                              epi_tile_m=em, epi_tile_n=en, grid_minor_dim=minor,
                              grid_tile_width=width, wg_dimension=wgd, schedule=schedule,
                              k_splits=splits, rhs_tile_n=rhs_tile_n, cluster_m=cluster_m,
                              chain_tiles=chain_tiles)
      except ValueError:
        continue  # E.g. an epilogue tile that does not divide the tile, or a split ping-pong.
      if config not in seen:
        seen.add(config)
        yield config


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
  config: TuningConfig
  median_us: float | None  # None: rejected (see `reason`).
  reason: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sweep:
  """What `tune` found.

  Attributes:
    timed: the configs that ran and matched the reference, fastest first; never empty.
    rejected: the configs that were tried and failed to compile, to run or to
      match the reference, in sweep order, each with its `reason`.
    stored_at: the cache file the winner went to (`store=True`), else None.
  """

  timed: tuple[Candidate, ...]
  rejected: tuple[Candidate, ...] = ()
  stored_at: pathlib.Path | None = None

  @property
  def best(self) -> Candidate:
    return self.timed[0]


class TuningError(RuntimeError):
  """No config of a sweep ran and matched the reference; `rejected` says why, per config."""

  def __init__(self, message: str, rejected: Sequence[Candidate]):
    super().__init__(message)
    self.rejected = tuple(rejected)


def _split_feasible(problem: operands.MatmulProblem, out_dtype,
                    space: SearchSpace | Iterable[TuningConfig]
                    ) -> tuple[list[TuningConfig], list[Candidate]]:
  """(configs that pass the problem and SMEM checks, the others with their reason)."""
  feasible, infeasible = [], []
  for config in space.configs() if isinstance(space, SearchSpace) else space:
    if not isinstance(config, TuningConfig):
      raise ValueError(f"space must be a SearchSpace or TuningConfigs, but holds "
                       f"{type(config).__name__} {config!r}")
    try:
      # Against the K that `ws_matmul` pads to, as it checks the config itself.
      kernel_call.check_ws_config(
          config, operands.pad_k(problem, config.tile_k), out_dtype)
    except ValueError as e:
      infeasible.append(Candidate(config=config, median_us=None,
                                  reason=f"infeasible: {e}"[:_REASON_CHARS]))
      continue
    feasible.append(config)
  return feasible, infeasible


def feasible_configs(problem: operands.MatmulProblem, out_dtype,
                     space: SearchSpace | Iterable[TuningConfig]) -> list[TuningConfig]:
  """Configs of `space` (or given ones) that pass the problem and SMEM checks
  (nothing compiled), for K padded as the matmul wrapper pads it."""
  return _split_feasible(problem, operands.check_out_dtype(out_dtype, problem.dtype), space)[0]


def _failure_summary(problem: operands.MatmulProblem, out_dtype,
                     failed: Sequence[Candidate]) -> str:
  """Why every config failed, grouped by the kind of failure, the largest group first."""
  shape = f"{problem.m}x{problem.k}x{problem.n} {problem.dtype.name}->{out_dtype.name}"
  if not failed:
    return f"the search space has no configs to try for {shape}"
  groups: dict[str, list[Candidate]] = {}
  for candidate in failed:
    # Reasons read "<kind>: <detail>": an exception's type, "wrong result" or "infeasible".
    groups.setdefault(candidate.reason.partition(":")[0], []).append(candidate)
  lines = [f"none of the {len(failed)} configs tried ran and matched the reference for "
           f"{shape}; by reason:"]
  for kind, candidates in sorted(groups.items(), key=lambda item: -len(item[1])):
    example = candidates[0]
    lines.append(f"  {len(candidates)}x {kind}, e.g. {example.config}: {example.reason}")
  return "\n".join(lines)


def tune(lhs: jax.Array, rhs: jax.Array, *, out_dtype=None,
         layout: operands.OperandLayout = operands.NN,
         space: SearchSpace | Iterable[TuningConfig] = SearchSpace(),
         timer: Callable | None = None, store: bool = False, log=sys.stderr) -> Sweep:
  """Times every feasible config of `space` on `op(lhs) @ op(rhs)`.

  Args:
    lhs, rhs: float16/bfloat16 operands (random data) stored as `layout` says:
      (M, K) or (K, M), and (K, N) or (N, K). Concrete arrays: the sweep
      compiles and times kernels, so it cannot run under `jax.jit` or another
      transformation.
    layout: how the operands are stored; part of the tuning-cache key.
    space: a `SearchSpace`, whose sweep also weighs the heuristic's config
      (`default_config`: split K, the decode tiles and the transposed decode
      product lie outside the default grid, so a tuned config is never the
      slower of the two); or exactly the configs to try.
    timer: `timer(fn, args) -> median microseconds`; CUPTI timing on the GPU by default.
    store: write the winner to the tuning cache (or, if that cannot be written,
      to the fallback file `tuning_cache.store` names; see `Sweep.stored_at`).

  Returns:
    A `Sweep`: the configs that matched the float32 reference, fastest first,
    and separately the rejected ones with their reasons.

  Raises:
    ValueError: `lhs` or `rhs` is a tracer, or invalid operands.
    TuningError: no config ran and matched the reference; the message counts
      the failures by kind, with an example of each.
  """
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if isinstance(x, jax.core.Tracer):
      raise ValueError(
          f"{name} is a traced value ({type(x).__name__}, shape {x.shape}): tune() compiles, "
          "checks and times kernels on concrete arrays, so it cannot run under jax.jit, "
          "jax.vmap or another transformation. Call it outside the transformation, or give "
          "matmul() a config= (or on_cache_miss='heuristic') under jit")
  problem = operands.check_operands(lhs, rhs, layout)
  out_dtype = operands.check_out_dtype(out_dtype, problem.dtype)
  if timer is None:
    def timer(fn, args):
      return timing.time_gpu("ws_matmul", fn, args, flops=problem.flops)[0].median_us
  if isinstance(space, SearchSpace):
    grid = list(space.configs())
    heuristic = default_config(problem, out_dtype)
    space = grid if heuristic in grid else [*grid, heuristic]
  configs, infeasible = _split_feasible(problem, out_dtype, space)
  reference = matmul_reference(lhs, rhs, layout=layout)
  tolerance = RELATIVE_TOLERANCE[problem.dtype]
  results = []
  for i, config in enumerate(configs):
    def run(a, b, config=config):
      return kernel_call.ws_matmul(a, b, config=config, out_dtype=out_dtype, layout=layout)
    try:
      err = relative_error_on_device(run(lhs, rhs), reference)
      if not err <= tolerance:
        results.append(Candidate(config=config, median_us=None,
                                 reason=f"wrong result: relative error {err:.2e} > {tolerance}"))
      elif not math.isfinite(median_us := timer(run, (lhs, rhs))):
        results.append(Candidate(config=config, median_us=None,
                                 reason=f"timing failed: the timer returned {median_us}"))
      else:
        results.append(Candidate(config=config, median_us=median_us))
    except Exception as e:  # A config Mosaic GPU cannot compile loses, it does not stop the sweep.
      reason = f"{type(e).__name__}: {e}"[:_REASON_CHARS]
      results.append(Candidate(config=config, median_us=None, reason=reason))
    last = results[-1]
    shown = f"{last.median_us:.1f} us" if last.median_us is not None else last.reason
    print(f"[{i + 1}/{len(configs)}] {config}: {shown}", file=log, flush=True)
  timed = tuple(sorted((c for c in results if c.median_us is not None),
                       key=lambda c: c.median_us))
  rejected = tuple(c for c in results if c.median_us is None)
  if not timed:
    raise TuningError(_failure_summary(problem, out_dtype, [*rejected, *infeasible]),
                      rejected)
  stored_at = None
  if store:
    try:
      stored_at = tuning_cache.store(problem, out_dtype, timed[0].config,
                                     median_us=timed[0].median_us)
    except OSError as e:
      # The sweep is finished: say what won rather than lose it to a failed write.
      _log.warning("%s; the winner was %s at %.1f us", e, timed[0].config, timed[0].median_us)
  return Sweep(timed=timed, rejected=rejected, stored_at=stored_at)
