"""Benchmarks the matmul kernels against cuBLAS (`jnp.dot`) and JAX's Hopper kernel.

    bazel run //tools:bench_matmul -- --out_dir=/tmp/bench

For each shape and dtype it times, on random normal data, our pipelined
kernel, our warp-specialized kernel (`pipelines.matmul`, tuning cache or
heuristic), `jnp.dot` and JAX's shipped `hopper_matmul_mgpu`, each as the
median of many CUPTI-timed runs after warm-up, and reports TFLOP/s and the
ratio to `jnp.dot` from the same run. The kernels take turns for `--rounds`
rounds: the clock of a GPU under sustained load drifts by several percent
within a minute, so each round's ratio compares runs seconds apart, and the
reported ratio is the median of the rounds' ratios (with their range).
`--sustain_s` adds the SM clock and power each kernel runs at over seconds of
back-to-back calls (`tools.gpu_sampling.sustained_run`).
`--ws_config` adds rows for given warp-specialized configs, e.g.

    --ws_config=schedule=PINGPONG,tile_m=128,tile_n=128,max_concurrent_steps=3

and `--heuristic_variant` rows of each problem's heuristic config with some fields
changed, e.g. `--heuristic_variant=max_concurrent_steps=5`.

`--suite=shapes` times the shape classes users have beyond the aligned suite
(M and N off the tiles, decode-size M, small outputs with a long K, K off 64),
`--suite=narrow` outputs at most 64 columns wide (N = 16-64), `--suite=models`
the GEMMs of published models' training and inference steps
(`tools.model_shapes`: projections, MLPs, LM heads, MoE experts, LoRA adapters,
decode), each problem in its own layout (--layout does not apply) and each
record tagged with its half, models, roles and steps; `--half=fit|check|both`
picks the half of its model families (the check half is what targets are
judged on), and the run ends with each kernel's median ratio per half and the
count below 0.95x, the heuristic alone beside the tuning cache. A run stopped by a
time limit is finished by another with `--skip_done=` its JSON. On an H200 with
`--iterations=15 --rounds=2 --pipelined_config= --peer=false` a models-suite problem
takes about 8 s (compiling XLA's dot and our kernel, mostly): a half (75 problems
in one dtype) about 10 minutes, more than one 600 s device call.
Where the tuning cache has an entry, a second row shows the heuristic's config.
`--layout=TN` (repeatable: NN, TN, NT, TT) times operands stored transposed,
against XLA's dot_general on the same stored arrays; `--backward` adds the
backward pass of a gelu layer against XLA's autodiff of it.

Writes `matmul_bench.json` and `matmul_bench.png` to `--out_dir` (a relative
one is relative to where the command ran, under `bazel run` too) and prints
where. Needs a Hopper GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics

import jax
import jax.numpy as jnp
from absl import flags

from core import device_facts, has_gpu, timing
from core.numerics import RELATIVE_TOLERANCE
from pipelines import (
  Epilogue,
  PipelinedConfig,
  TuningConfig,
  default_config,
  matmul,
  matmul_reference,
  pipelined_matmul,
  tuning_cache,
)
from pipelines.matmul import choose_config
from pipelines.operands import NN, MatmulProblem, OperandLayout
from tools import cli, gpu_sampling, model_shapes, report

# The aligned suite: tile-multiple shapes, where the kernels were first tuned.
SUITE = ((1024, 4096, 4096), (4096, 4096, 4096), (8192, 8192, 8192), (4096, 8192, 4096),
         (8192, 8192, 1024), (16384, 1024, 8192))
# The shape classes users have beyond it: M and N off every tile multiple,
# decode-size M with large K and N, small outputs with a long K, and K a
# multiple of 16 but not of 64.
SHAPE_CLASSES = ((1000, 4096, 3000), (333, 2048, 1111), (4999, 4096, 2500), (100, 8192, 4000),
                 (1, 8192, 8192), (16, 8192, 8192), (64, 4096, 14336),
                 (256, 16384, 256), (128, 32768, 128),
                 (4096, 80, 4096), (8192, 144, 8192), (2048, 48, 2048))
# Outputs at most 64 columns wide (low-rank projections, routers), which the
# heuristic gives 64-column CTA tiles.
NARROW_OUTPUTS = ((64, 4096, 64), (1000, 4096, 64), (4096, 4096, 64), (4096, 14336, 64),
                  (3000, 4096, 48), (8192, 4096, 32), (4096, 4096, 16), (16384, 4096, 16))
# The GEMMs of published models (tools.model_shapes): problems, each with its own layout,
# half, models, roles and steps, where the other suites are (M, K, N) timed in --layout.
MODEL_SUITE = "models"
SUITES = {"aligned": SUITE, "shapes": SHAPE_CLASSES, "narrow": NARROW_OUTPUTS,
          MODEL_SUITE: model_shapes.suite()}
BOTH_HALVES = "both"
# A kernel below this ratio to jnp.dot on a problem is counted in the end-of-run summary.
SLOW_RATIO = 0.95
WARP_SPECIALIZED = "ours: warp-specialized"
HEURISTIC = "ours: heuristic config"
HEURISTIC_ALONE = "ours: heuristic alone (no tuning cache)"

_SUITE = flags.DEFINE_enum("suite", "aligned", list(SUITES),
                           "Shapes to time when --shapes is not given: the aligned suite, "
                           "the shape classes (ragged, decode-size, long-K, K off 64), "
                           "outputs at most 64 columns wide, or the GEMMs of published "
                           "models (each in its own layout).")
_HALF = flags.DEFINE_enum("half", BOTH_HALVES, [*model_shapes.HALVES, BOTH_HALVES],
                          "The half of --suite=models to time: the model families constants "
                          "are fitted on, those they are checked on, or both.")
_SHAPES = flags.DEFINE_list("shapes", None, "Problems as MxKxN (instead of --suite).")
_DTYPES = flags.DEFINE_list("dtypes", ["float16", "bfloat16"], "Operand dtypes.")
_ITERATIONS = flags.DEFINE_integer("iterations", 50, "Timed runs per kernel and round.",
                                   lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds in which the kernels take turns.",
                               lower_bound=1)
_SUSTAIN_S = flags.DEFINE_float(
    "sustain_s", 0.0, "Also run each kernel back to back for this many seconds, sampling "
    "the SM clock and power with nvidia-smi (0: skip).")
_OUT_DIR = flags.DEFINE_string("out_dir", os.environ.get("OUT", "out"),
                               "Where results go; relative to where the command ran.")
_PEER = flags.DEFINE_bool("peer", True, "Also time JAX's hopper_matmul_mgpu.")
_PIPELINED = flags.DEFINE_multi_string(
    "pipelined_config", ["tile_m=128,tile_n=128,tile_k=64,max_concurrent_steps=4,delay_release=1"],
    "PipelinedConfig fields for the pipelined kernel; repeat the flag to time several, or "
    "give it empty (--pipelined_config=) to skip that kernel.")
_LAYOUTS = flags.DEFINE_multi_enum(
    "layout", ["NN"], ["NN", "TN", "NT", "TT"],
    "Operand layouts (T: stored transposed, lhs then rhs); repeat the flag for several.")
_BACKWARD = flags.DEFINE_bool(
    "backward", False, "Also time the backward pass of gelu(lhs @ rhs + bias) against XLA's.")
_SKIP_DONE = flags.DEFINE_string(
    "skip_done", None, "A matmul_bench.json of an earlier run (a path relative to where the "
    "command ran): problems it timed in a dtype and layout are not timed again, so a run "
    "stopped by a time limit can be finished by another.")
_WS_CONFIGS = flags.DEFINE_multi_string(
    "ws_config", [], "TuningConfig fields for extra warp-specialized rows (besides the "
    "cache/heuristic one); repeat the flag to time several.")
_HEURISTIC_VARIANTS = flags.DEFINE_multi_string(
    "heuristic_variant", [], "TuningConfig fields set over each problem's heuristic config "
    "(e.g. max_concurrent_steps=5), a row each; repeat the flag to time several. Where a "
    "variant is no valid config of a problem, its row is left out, saying why.")


def _peer_matmul():
  """JAX's own Hopper kernel with its best config measured here
  (docs/performance-log.md, "The first suite")."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as peer

  config = peer.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                             grid_minor_dim=peer.MatmulDimension.M, grid_tile_width=8,
                             wg_dimension=peer.MatmulDimension.N)
  return lambda a, b: peer.matmul(a, b, None, config)


def _stored_operands(m: int, k: int, n: int, dtype, layout: OperandLayout):
  """Random operands of an (M, K) x (K, N) problem, stored as `layout` says."""
  lhs, rhs = cli.random_operands(m, k, n, dtype)
  return (lhs.T if layout.transpose_lhs else lhs), (rhs.T if layout.transpose_rhs else rhs)


def xla_dot(layout: OperandLayout):
  """The baseline: `op(lhs) @ op(rhs)` as `jnp.dot` runs it, XLA's dot_general
  on the stored layout (cuBLAS takes transposed operands as they are) with
  the output in the operand dtype, as ours writes it. cuBLAS accumulates in
  float32 either way; asking for a float32 output instead would make it
  write twice the bytes and add a conversion pass (at 8192x4096x14336 bf16,
  1351 against 1165 us on an H200)."""
  return lambda lhs, rhs: jax.lax.dot_general(lhs, rhs, layout.dimension_numbers)


def _time_in_rounds(impls: dict, args, *, flops: int, baseline: str, reference) -> dict:
  """Times `impls` taking turns for --rounds rounds (`timing.time_in_rounds`); each
  record says whether its error is within its operands' tolerance."""
  records = timing.time_in_rounds(impls, args, flops=flops, baseline=baseline,
                                  reference=reference, iterations=_ITERATIONS.value,
                                  rounds=_ROUNDS.value)
  tolerance = RELATIVE_TOLERANCE[jnp.dtype(args[0].dtype)]
  for name, record in records.items():
    if "error" not in record:
      record["correct"] = record["rel_error"] <= tolerance
      if _SUSTAIN_S.value:
        record.update(gpu_sampling.sustained_run(impls[name], args, flops=flops,
                                                 seconds=_SUSTAIN_S.value))
  return records


def warp_specialized_configs(problem: MatmulProblem, dtype) -> dict[str, TuningConfig]:
  """The warp-specialized rows of `problem` and the config each runs: what
  `matmul` chooses (the tuning cache, else the heuristic), the heuristic's
  where the cache has an entry, and each `--ws_config`."""
  configs = {WARP_SPECIALIZED: choose_config(problem, dtype)}
  heuristic_config = default_config(problem, dtype)
  if tuning_cache.lookup(problem, dtype) is not None:
    # The row above takes the cached config; this one shows what a shape
    # outside the cache gets.
    configs[HEURISTIC] = heuristic_config
  for text in _WS_CONFIGS.value:
    configs[f"ours: warp-specialized [{text}]"] = cli.parse_config(TuningConfig, text)
  for text in _HEURISTIC_VARIANTS.value:
    try:
      configs[f"{HEURISTIC} [{text}]"] = dataclasses.replace(
          heuristic_config, **cli.parse_fields(TuningConfig, text))
    except ValueError as e:
      print(f"{problem}: --heuristic_variant={text} left out: {e}")
  return configs


def bench_problem(m: int, k: int, n: int, dtype, layout: OperandLayout = NN) -> list[dict]:
  """Times every implementation on one problem; returns one record per kernel,
  with the config of each warp-specialized one."""
  lhs, rhs = _stored_operands(m, k, n, dtype, layout)
  transposes = dict(transpose_lhs=layout.transpose_lhs, transpose_rhs=layout.transpose_rhs)
  configs = warp_specialized_configs(
      MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(dtype), layout=layout), dtype)
  impls = {"jnp.dot": xla_dot(layout),
           **{name: functools.partial(matmul, config=config, **transposes)
              for name, config in configs.items()}}
  if layout == NN:  # The pipelined kernel and JAX's own take (M, K) x (K, N) only.
    for text in filter(None, _PIPELINED.value):
      name = "ours: pipelined" + (f" [{text}]" if len(_PIPELINED.value) > 1 else "")
      config = cli.parse_config(PipelinedConfig, text)
      impls[name] = functools.partial(pipelined_matmul, config=config)
    if _PEER.value:
      impls["jax hopper_matmul_mgpu"] = _peer_matmul()
  records = _time_in_rounds(impls, (lhs, rhs), flops=2 * m * k * n, baseline="jnp.dot",
                            reference=matmul_reference(lhs, rhs, layout=layout))
  return [dict(r, shape=f"{m}x{k}x{n}", dtype=jnp.dtype(dtype).name, layout=layout.name,
               **({"config": repr(configs[r["kernel"]])} if r["kernel"] in configs else {}))
          for r in records.values()]


def xla_gelu_layer(lhs, rhs, bias):
  """`gelu(lhs @ rhs + bias)` as a user writes it in the operand dtype (the
  bias cast to it): the baseline of `bench_backward`, whose backward products
  then take a cotangent of the operand dtype, as ours do."""
  return jax.nn.gelu(jnp.dot(lhs, rhs) + bias.astype(lhs.dtype), approximate=True)


def bench_backward(m: int, k: int, n: int, dtype) -> list[dict]:
  """The backward pass of `gelu(lhs @ rhs + bias)` (d lhs, d rhs, d bias), ours
  (the derivative kept by the forward, two matmuls reading the operands as
  stored) against XLA's autodiff of the same layer on `jnp.dot`, in the same run."""
  lhs, rhs = cli.random_operands(m, k, n, dtype)
  bias = jax.random.normal(jax.random.key(7), (n,), jnp.float32)
  cotangent = jax.random.normal(jax.random.key(8), (m, n), jnp.float32).astype(dtype)
  epilogue = Epilogue(activation="gelu", has_bias=True)

  def backward(layer):
    def run(a, b, c):
      out, vjp = jax.vjp(layer, a, b, c)
      return vjp(cotangent.astype(out.dtype))
    return run

  impls = {"backward: jnp.dot (XLA autodiff)": backward(xla_gelu_layer),
           "backward: ours": backward(functools.partial(matmul, activation="gelu"))}
  reference = backward(functools.partial(matmul_reference, epilogue=epilogue))(
      lhs.astype(jnp.float32), rhs.astype(jnp.float32), bias)
  # Both also run the forward product, which the backward needs; the FLOPs
  # counted are the backward's two products.
  records = _time_in_rounds(impls, (lhs, rhs, bias), flops=2 * 2 * m * k * n,
                            baseline="backward: jnp.dot (XLA autodiff)", reference=reference)
  return [dict(r, shape=f"{m}x{k}x{n}", dtype=jnp.dtype(dtype).name, layout="NN")
          for r in records.values()]


def plot(records: list[dict], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  if any("half" in r for r in records):
    _plot_halves(plt, records, path)
    return
  groups = sorted({(r["shape"], r["dtype"], r["layout"]) for r in records})
  kernels = sorted({r["kernel"] for r in records})
  fig, ax = plt.subplots(figsize=(max(8, len(groups) * 1.4), 5))
  width = 0.8 / len(kernels)
  for i, kernel in enumerate(kernels):
    ys = [next((r.get("tflops", 0) for r in records
                if (r["shape"], r["dtype"], r["layout"], r["kernel"]) == (*g, kernel)), 0)
          for g in groups]
    ax.bar([x + i * width for x in range(len(groups))], ys, width, label=kernel)
  ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))])
  ax.set_xticklabels([f"{s}\n{d} {layout}" for s, d, layout in groups], fontsize=7)
  ax.set_ylabel("TFLOP/s")
  ax.set_title(f"matmul on {device_facts().name}")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def _plot_halves(plt, records: list[dict], path: str) -> None:
  """The models suite, one panel per half: each kernel's ratios to jnp.dot over the
  half's problems, sorted (a bar per problem would be a plot hundreds of bars wide)."""
  halves = [h for h in model_shapes.HALVES if any(r.get("half") == h for r in records)]
  fig, axes = plt.subplots(1, len(halves), figsize=(7 * len(halves), 4.5), squeeze=False)
  for ax, half in zip(axes[0], halves, strict=True):
    group = [r for r in records if r.get("half") == half and "ratio_to_dot" in r]
    for kernel in sorted({r["kernel"] for r in group} - {"jnp.dot"}):
      ratios = sorted(r["ratio_to_dot"] for r in group if r["kernel"] == kernel)
      ax.plot(range(len(ratios)), ratios, marker=".", label=kernel)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.axhline(SLOW_RATIO, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xlabel("problems (both dtypes), sorted by ratio")
    ax.set_ylabel("ratio to jnp.dot (above 1: faster)")
    ax.set_title(f"{half} half, {device_facts().name}")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def problem_list(suite: str, layouts: list[OperandLayout], *, shapes=None,
                 half: str = BOTH_HALVES) -> list[tuple[tuple[int, int, int], list, dict]]:
  """What a run times: (M, K, N), the layouts to time it in and the tags its records carry.

  `shapes` (--shapes) or the suite's shapes, each in every one of `layouts`; the models
  suite's problems of `half`, each in its own layout, tagged with its half, models,
  roles and steps.
  """
  if shapes or suite != MODEL_SUITE:
    return [(tuple(shape), list(layouts), {}) for shape in shapes or SUITES[suite]]
  return [((p.m, p.k, p.n), [p.layout],
           dict(half=p.half, models=list(p.models), roles=list(p.roles), steps=list(p.steps)))
          for p in SUITES[suite] if half in (BOTH_HALVES, p.half)]


def done_problems(records: list[dict]) -> set[tuple[str, str, str]]:
  """The (shape, dtype, layout) that `records` (a run's JSON) timed `jnp.dot` on."""
  return {(r["shape"], r["dtype"], r["layout"]) for r in records
          if r.get("kernel") == "jnp.dot" and "median_us" in r}


def ratio_summary(records: list[dict]) -> list[str]:
  """Each kernel's median ratio to jnp.dot; for the models suite per half, with the
  count below SLOW_RATIO, and the heuristic alone: per problem, the heuristic config's
  row where the tuning cache has an entry, else the warp-specialized one (which then
  runs the heuristic's config)."""
  lines = []
  for half in (None, *model_shapes.HALVES):  # None: the other suites' records.
    group = [r for r in records if r.get("half") == half]
    ratios = {}
    for r in group:
      if "ratio_to_dot" in r:
        ratios.setdefault(r["kernel"], []).append(r["ratio_to_dot"])
    if half is None:
      lines += [f"median ratio to jnp.dot, {kernel}: {statistics.median(ratios[kernel]):.3f}"
                for kernel in sorted(ratios)]
      continue
    chosen = {}  # (shape, dtype, layout) -> the heuristic's record.
    for r in group:
      key = (r["shape"], r["dtype"], r["layout"])
      if r["kernel"] == HEURISTIC or (r["kernel"] == WARP_SPECIALIZED and key not in chosen):
        chosen[key] = r
    heuristic = [r["ratio_to_dot"] for r in chosen.values() if "ratio_to_dot" in r]
    if heuristic:
      ratios[HEURISTIC_ALONE] = heuristic
    for kernel in sorted(ratios):
      values = ratios[kernel]
      slow = sum(v < SLOW_RATIO for v in values)
      lines.append(f"median ratio to jnp.dot, {half} half, {kernel}: "
                   f"{statistics.median(values):.3f} ({slow} of {len(values)} below "
                   f"{SLOW_RATIO}x)")
  return lines


def main(argv):
  del argv
  # An unknown field or value, or a config that cannot be, fails here rather than after
  # the problems before it were timed.
  for text in _WS_CONFIGS.value:
    cli.parse_config(TuningConfig, text)
  for text in _HEURISTIC_VARIANTS.value:
    cli.parse_fields(TuningConfig, text)
  if not has_gpu():
    raise SystemExit("bench_matmul needs a Hopper GPU; none is visible to JAX.")
  out_dir = cli.output_dir(_OUT_DIR.value)
  records = []
  layouts = [OperandLayout(transpose_lhs=name[0] == "T", transpose_rhs=name[1] == "T")
             for name in _LAYOUTS.value]
  shapes = [cli.parse_shape(shape) for shape in _SHAPES.value or ()]
  json_path, png_path = (os.path.join(out_dir, name)
                         for name in ("matmul_bench.json", "matmul_bench.png"))
  done = set()
  if _SKIP_DONE.value:
    with open(cli.user_path(_SKIP_DONE.value)) as f:
      done = done_problems(json.load(f))
  for (m, k, n), problem_layouts, tags in problem_list(_SUITE.value, layouts, shapes=shapes,
                                                       half=_HALF.value):
    for dtype in _DTYPES.value:
      for layout in problem_layouts:
        if (f"{m}x{k}x{n}", jnp.dtype(dtype).name, layout.name) in done:
          continue
        records += [dict(r, **tags) for r in bench_problem(m, k, n, jnp.dtype(dtype), layout)]
      if _BACKWARD.value:
        records += [dict(r, **tags) for r in bench_backward(m, k, n, jnp.dtype(dtype))]
    # Written after each problem, so a run stopped early (a time limit) keeps
    # what it measured.
    report.write_json(json_path, records)
  columns = ["shape", "dtype", "layout", "kernel", "median_us", "tflops", "ratio_to_dot",
             "ratio_min", "ratio_max", "rel_error", "error"]
  if _SUSTAIN_S.value:
    columns[-2:-2] = ["wallclock_tflops", "sm_clock_mhz", "power_w", "clock_event_reasons"]
  if any("half" in r for r in records):
    columns[3:3] = ["half", "steps", "models"]
  report.print_table(records, columns)
  for line in ratio_summary(records):
    print(line)
  report.write_json(json_path, records)
  report.write_plot(plot, records, png_path)
  cli.say_written([json_path, png_path])


if __name__ == "__main__":
  cli.run(main)
