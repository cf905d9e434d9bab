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

Writes `matmul_bench.json` and `matmul_bench.png` to `--out_dir`. Needs a
Hopper GPU.
"""

from __future__ import annotations

import functools
import os
import statistics

import jax.numpy as jnp
from absl import app, flags

from core import device_facts, has_gpu, timing
from core.numerics import RELATIVE_TOLERANCE, relative_error
from pipelines import PipelinedConfig, TuningConfig, matmul, matmul_reference, pipelined_matmul
from tools import cli, gpu_sampling, report

SUITE = ((1024, 4096, 4096), (4096, 4096, 4096), (8192, 8192, 8192), (4096, 8192, 4096),
         (8192, 8192, 1024), (16384, 1024, 8192))

_SHAPES = flags.DEFINE_list("shapes", [f"{m}x{k}x{n}" for m, k, n in SUITE],
                            "Problems as MxKxN.")
_DTYPES = flags.DEFINE_list("dtypes", ["float16", "bfloat16"], "Operand dtypes.")
_ITERATIONS = flags.DEFINE_integer("iterations", 50, "Timed runs per kernel and round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds in which the kernels take turns.")
_SUSTAIN_S = flags.DEFINE_float(
    "sustain_s", 0.0, "Also run each kernel back to back for this many seconds, sampling "
    "the SM clock and power with nvidia-smi (0: skip).")
_OUT_DIR = flags.DEFINE_string("out_dir", os.environ.get("OUT", "out"), "Where results go.")
_PEER = flags.DEFINE_bool("peer", True, "Also time JAX's hopper_matmul_mgpu.")
_PIPELINED = flags.DEFINE_multi_string(
    "pipelined_config", ["tile_m=128,tile_n=128,tile_k=64,max_concurrent_steps=4,delay_release=1"],
    "PipelinedConfig fields for the pipelined kernel; repeat the flag to time several.")
_WS_CONFIGS = flags.DEFINE_multi_string(
    "ws_config", [], "TuningConfig fields for extra warp-specialized rows (besides the "
    "cache/heuristic one); repeat the flag to time several.")


def _peer_matmul():
  """JAX's own Hopper kernel with its best config measured here (ENVIRONMENT notes)."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as peer

  config = peer.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                             grid_minor_dim=peer.MatmulDimension.M, grid_tile_width=8,
                             wg_dimension=peer.MatmulDimension.N)
  return lambda a, b: peer.matmul(a, b, None, config)


def bench_problem(m: int, k: int, n: int, dtype) -> list[dict]:
  """Times every implementation on one problem; returns one record per kernel."""
  lhs, rhs = cli.random_operands(m, k, n, dtype)
  flops = 2 * m * k * n
  reference = matmul_reference(lhs, rhs)
  impls = {
      "jnp.dot": jnp.dot,
      "ours: warp-specialized": matmul,
  }
  for text in _WS_CONFIGS.value:
    config = cli.parse_config(TuningConfig, text)
    impls[f"ours: warp-specialized [{text}]"] = functools.partial(matmul, config=config)
  for text in _PIPELINED.value:
    name = "ours: pipelined" + (f" [{text}]" if len(_PIPELINED.value) > 1 else "")
    config = cli.parse_config(PipelinedConfig, text)
    impls[name] = functools.partial(pipelined_matmul, config=config)
  if _PEER.value:
    impls["jax hopper_matmul_mgpu"] = _peer_matmul()
  timings = {name: [] for name in impls}
  records = {}
  for _ in range(_ROUNDS.value):
    for name, fn in impls.items():
      if name in records and "error" in records[name]:
        continue
      try:
        t, out = timing.time_gpu(name, fn, (lhs, rhs), flops=flops,
                                 iterations=_ITERATIONS.value)
      except Exception as e:  # Report a kernel that fails; keep benchmarking the others.
        records[name] = dict(kernel=name, error=f"{type(e).__name__}: {e}"[:300])
        continue
      timings[name].append(t)
      if name not in records:
        err = relative_error(out, reference)
        records[name] = dict(kernel=name, compile_s=t.compile_s, rel_error=err,
                             correct=err <= RELATIVE_TOLERANCE[jnp.dtype(dtype)])
  for name, record in records.items():
    record.update(shape=f"{m}x{k}x{n}", dtype=jnp.dtype(dtype).name)
    if "error" not in record:
      summary = timing.compare_rounds(timings[name], timings["jnp.dot"])
      record.update(summary, ratio_to_dot=summary.pop("ratio"))
      if _SUSTAIN_S.value:
        record.update(gpu_sampling.sustained_run(impls[name], (lhs, rhs), flops=flops,
                                                 seconds=_SUSTAIN_S.value))
  return list(records.values())


def plot(records: list[dict], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  groups = sorted({(r["shape"], r["dtype"]) for r in records})
  kernels = sorted({r["kernel"] for r in records})
  fig, ax = plt.subplots(figsize=(max(8, len(groups) * 1.4), 5))
  width = 0.8 / len(kernels)
  for i, kernel in enumerate(kernels):
    ys = [next((r.get("tflops", 0) for r in records
                if (r["shape"], r["dtype"], r["kernel"]) == (*g, kernel)), 0) for g in groups]
    ax.bar([x + i * width for x in range(len(groups))], ys, width, label=kernel)
  ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))])
  ax.set_xticklabels([f"{s}\n{d}" for s, d in groups], fontsize=7)
  ax.set_ylabel("TFLOP/s")
  ax.set_title(f"matmul on {device_facts().name}")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  if not has_gpu():
    raise SystemExit("bench_matmul needs a Hopper GPU; none is visible to JAX.")
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  records = []
  for shape in _SHAPES.value:
    m, k, n = cli.parse_shape(shape)
    for dtype in _DTYPES.value:
      records += bench_problem(m, k, n, jnp.dtype(dtype))
  columns = ["shape", "dtype", "kernel", "median_us", "tflops", "ratio_to_dot", "ratio_min",
             "ratio_max", "rel_error", "error"]
  if _SUSTAIN_S.value:
    columns[-2:-2] = ["wallclock_tflops", "sm_clock_mhz", "power_w", "clock_event_reasons"]
  report.print_table(records, columns)
  for kernel in sorted({r["kernel"] for r in records}):
    ratios = [r["ratio_to_dot"] for r in records if r["kernel"] == kernel and "ratio_to_dot" in r]
    if ratios:
      print(f"median ratio to jnp.dot, {kernel}: {statistics.median(ratios):.3f}")
  report.write_json(os.path.join(_OUT_DIR.value, "matmul_bench.json"), records)
  report.write_plot(plot, records, os.path.join(_OUT_DIR.value, "matmul_bench.png"))


if __name__ == "__main__":
  app.run(main)
