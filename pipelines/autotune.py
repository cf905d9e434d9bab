"""A config sweep for the warp-specialized matmul.

Candidates the SMEM budget rejects, or that do not fit the problem, are
skipped without compiling. Each survivor is compiled, checked against the
float32 reference (a config that computes wrong numbers never wins) and timed;
the winner can be stored in the tuning cache that `matmul()` reads.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Callable, Iterable

import jax

from core import timing
from core.numerics import RELATIVE_TOLERANCE, relative_error
from pipelines import operands, tuning_cache, ws_matmul_sm90
from pipelines.config import MatmulDimension, Schedule, TuningConfig
from pipelines.reference import matmul_reference


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

  def configs(self) -> Iterable[TuningConfig]:
    seen = set()
    for tm, tn, tk, steps, (em, en), minor, width, wgd, schedule, splits in itertools.product(
        self.tile_m, self.tile_n, self.tile_k, self.max_concurrent_steps, self.epi_tile,
        self.grid_minor_dim, self.grid_tile_width, self.wg_dimension, self.schedule,
        self.k_splits):
      if schedule == Schedule.PINGPONG:
        wgd = MatmulDimension.N  # No split under ping-pong: one config, not two.
      try:
        config = TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=steps,
                              epi_tile_m=em, epi_tile_n=en, grid_minor_dim=minor,
                              grid_tile_width=width, wg_dimension=wgd, schedule=schedule,
                              k_splits=splits)
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


def feasible_configs(problem: operands.MatmulProblem, out_dtype,
                     space: SearchSpace | Iterable[TuningConfig]) -> list[TuningConfig]:
  """Configs of `space` (or given ones) that pass the problem and SMEM checks
  (nothing compiled)."""
  out = []
  for config in space.configs() if isinstance(space, SearchSpace) else space:
    try:
      ws_matmul_sm90.check_config(config, problem, out_dtype)
    except ValueError:
      continue
    out.append(config)
  return out


def tune(lhs: jax.Array, rhs: jax.Array, *, out_dtype=None,
         space: SearchSpace | Iterable[TuningConfig] = SearchSpace(),
         timer: Callable | None = None, store: bool = False, log=sys.stderr) -> list[Candidate]:
  """Times every feasible config of `space` on `lhs @ rhs`; best first.

  Args:
    lhs, rhs: (M, K) and (K, N) float16/bfloat16 operands (random data).
    space: a `SearchSpace`, or the configs to try.
    timer: `timer(fn, args) -> median microseconds`; CUPTI timing on the GPU by default.
    store: write the winner to the tuning cache.
  """
  problem = operands.check_operands(lhs, rhs)
  out_dtype = operands.check_out_dtype(out_dtype, problem.dtype)
  if timer is None:
    def timer(fn, args):
      return timing.time_gpu("ws_matmul", fn, args, flops=problem.flops)[0].median_us
  configs = feasible_configs(problem, out_dtype, space)
  reference = matmul_reference(lhs, rhs)
  results = []
  for i, config in enumerate(configs):
    def run(a, b, config=config):
      return ws_matmul_sm90.ws_matmul(a, b, config=config, out_dtype=out_dtype)
    try:
      err = relative_error(run(lhs, rhs), reference)
      if not err <= RELATIVE_TOLERANCE[problem.dtype]:
        results.append(Candidate(config=config, median_us=None, reason=f"rel. error {err:.2e}"))
        continue
      median = timer(run, (lhs, rhs))
      results.append(Candidate(config=config, median_us=median))
    except Exception as e:  # A config Mosaic GPU cannot compile loses, it does not stop the sweep.
      reason = f"{type(e).__name__}: {e}"[:200]
      results.append(Candidate(config=config, median_us=None, reason=reason))
    last = results[-1]
    shown = f"{last.median_us:.1f} us" if last.median_us else last.reason
    print(f"[{i + 1}/{len(configs)}] {config}: {shown}", file=log, flush=True)
  timed = sorted((c for c in results if c.median_us is not None), key=lambda c: c.median_us)
  if store and timed:
    tuning_cache.store(problem, out_dtype, timed[0].config, median_us=timed[0].median_us)
  return timed + [c for c in results if c.median_us is None]
