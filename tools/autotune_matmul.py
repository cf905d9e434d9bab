"""Sweeps warp-specialized matmul configs on this GPU and stores the winners.

    bazel run //tools:autotune_matmul -- --shapes=4096x4096x4096 --dtypes=float16

`--config` (repeated) sweeps exactly the configs given instead of a space.

Writes each winner into the tuning cache (`pipelines/tuning_cache.json`, or
`--cache`), keyed by GPU kind, jax version and problem, and the full sweep to
`--out_dir/autotune_<shape>_<dtype>_<layout>.json`: the configs that passed,
fastest first, then the rejected ones with their reasons. Relative paths are
relative to where the command ran, under `bazel run` too. A problem for which no config
passes is reported and skipped; the exit status is then nonzero. Needs a Hopper GPU.
"""

from __future__ import annotations

import dataclasses
import os

from absl import flags

from core import has_gpu
from pipelines import autotune, operands, tuning_cache
from pipelines.config import Schedule, TuningConfig
from tools import cli, report

_SHAPES = flags.DEFINE_list("shapes", ["4096x4096x4096"], "Problems as MxKxN.")
_DTYPES = flags.DEFINE_list("dtypes", ["float16"], "Operand dtypes.")
_LAYOUT = flags.DEFINE_enum("layout", "NN", ["NN", "TN", "NT", "TT"],
                            "Operand layout (T: stored transposed, lhs then rhs).")
_OUT_DIR = flags.DEFINE_string("out_dir", os.environ.get("OUT", "out"),
                               "Where sweeps go; relative to where the command ran.")
_CACHE = flags.DEFINE_string("cache", None, "Tuning cache file to update.")
_QUICK = flags.DEFINE_bool(
    "quick", False, "A smaller search space: 4 slots, widths 8 and 16, 64x64 epilogue tiles.")
_TILE_M = flags.DEFINE_list("tile_m", None, "Override the space's tile_m values.")
_TILE_N = flags.DEFINE_list("tile_n", None, "Override the space's tile_n values.")
_STEPS = flags.DEFINE_list("steps", None, "Override the space's max_concurrent_steps values.")
_WIDTHS = flags.DEFINE_list("widths", None, "Override the space's grid_tile_width values.")
_MINOR = flags.DEFINE_list("minor", None, "Override the space's grid_minor_dim values (M, N).")
_EPI = flags.DEFINE_list("epi_tiles", None, "Override the space's epilogue tiles, as MxN.")
_SCHEDULES = flags.DEFINE_list("schedules", None,
                               "Override the space's schedules (COOPERATIVE, PINGPONG).")
_K_SPLITS = flags.DEFINE_list("k_splits", None,
                              "Override the space's k_splits values (split-K; default 1).")
_RHS_TILE_N = flags.DEFINE_list("rhs_tile_n", None,
                                 "Override the space's rhs_tile_n values (None: the warpgroup "
                                 "tile's width; 64: one-segment RHS tiles).")
_CLUSTER_M = flags.DEFINE_list("cluster_m", None,
                               "Override the space's cluster_m values (1, 2: RHS multicast).")
_CHAIN_TILES = flags.DEFINE_list("chain_tiles", None,
                                 "Override the space's chain_tiles values (false, true: a "
                                 "cooperative block's tiles on one ring of slots).")
_CONFIGS = flags.DEFINE_multi_string(
    "config", [], "Sweep exactly these configs instead of a space: TuningConfig fields, e.g. "
    "schedule=PINGPONG,tile_m=128,tile_n=192; repeat the flag for each.")

QUICK_SPACE = autotune.SearchSpace(max_concurrent_steps=(4,), grid_tile_width=(8, 16),
                                   epi_tile=((64, 64),))


def search_space() -> autotune.SearchSpace | list[TuningConfig]:
  if _CONFIGS.value:
    return [cli.parse_config(TuningConfig, text) for text in _CONFIGS.value]
  space = QUICK_SPACE if _QUICK.value else autotune.SearchSpace()
  ints = lambda values: tuple(int(v) for v in values)  # noqa: E731
  overrides = {
      "tile_m": _TILE_M.value and ints(_TILE_M.value),
      "tile_n": _TILE_N.value and ints(_TILE_N.value),
      "max_concurrent_steps": _STEPS.value and ints(_STEPS.value),
      "grid_tile_width": _WIDTHS.value and ints(_WIDTHS.value),
      "grid_minor_dim": _MINOR.value and tuple(autotune.MatmulDimension[v] for v in _MINOR.value),
      "epi_tile": _EPI.value and tuple(cli.parse_shape(v, 2) for v in _EPI.value),
      "schedule": _SCHEDULES.value and tuple(Schedule[v] for v in _SCHEDULES.value),
      "k_splits": _K_SPLITS.value and ints(_K_SPLITS.value),
      "rhs_tile_n": _RHS_TILE_N.value and tuple(None if v == "None" else int(v)
                                                for v in _RHS_TILE_N.value),
      "cluster_m": _CLUSTER_M.value and ints(_CLUSTER_M.value),
      "chain_tiles": _CHAIN_TILES.value and tuple(
          cli.parse_bool(v, error="--chain_tiles takes true or false") for v in _CHAIN_TILES.value),
  }
  return dataclasses.replace(space, **{k: v for k, v in overrides.items() if v})


def _rows(candidates) -> list[dict]:
  return [dict(tuning_cache.config_to_json(c.config), median_us=c.median_us, reason=c.reason)
          for c in candidates]


def main(argv):
  del argv
  if not has_gpu():
    raise SystemExit("autotune_matmul needs a Hopper GPU; none is visible to JAX.")
  if _CACHE.value:
    os.environ[tuning_cache.CACHE_ENV] = cli.user_path(_CACHE.value)
  out_dir = cli.output_dir(_OUT_DIR.value)
  space = search_space()
  layout = operands.OperandLayout(transpose_lhs=_LAYOUT.value[0] == "T",
                                  transpose_rhs=_LAYOUT.value[1] == "T")
  failed = []
  for shape in _SHAPES.value:
    m, k, n = cli.parse_shape(shape)
    for dtype in _DTYPES.value:
      lhs, rhs = cli.random_operands(m, k, n, dtype)
      # Stored as the layout says (a transposed copy here is outside the timing).
      lhs = lhs.T if layout.transpose_lhs else lhs
      rhs = rhs.T if layout.transpose_rhs else rhs
      out_json = os.path.join(out_dir, f"autotune_{shape}_{dtype}_{layout.name}.json")
      try:
        sweep = autotune.tune(lhs, rhs, layout=layout, space=space, store=True)
      except autotune.TuningError as e:
        # Keep the rejections for a look at why, and go on to the next problem.
        report.write_json(out_json, _rows(e.rejected))
        print(f"== {shape} {dtype} {layout.name}: nothing passed (reasons in {out_json})\n{e}")
        failed.append(f"{shape} {dtype} {layout.name}")
        continue
      report.write_json(out_json, _rows(sweep.timed + sweep.rejected))
      cli.say_written([out_json])
      stored = sweep.stored_at or "no cache file (see the warning above)"
      print(f"== {shape} {dtype} {layout.name}: best of {len(sweep.timed)} that passed "
            f"({len(sweep.rejected)} rejected); winner stored in {stored}")
      report.print_table(_rows(sweep.timed[:5]),
                         [f.name for f in dataclasses.fields(autotune.TuningConfig)]
                         + ["median_us"])
  if failed:
    raise SystemExit(f"no config passed for: {', '.join(failed)}")


if __name__ == "__main__":
  cli.run(main)
