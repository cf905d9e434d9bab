"""Benchmarks the all-gather matmul against NCCL all-gather + cuBLAS, per device count.

    bazel run //tools:bench_allgather_matmul -- --out_dir=/tmp/bench

The reference results' problem by default: float16, M_shard 1024, K 4096,
N_shard 4096 on 2, 4 and 8 GPUs (the counts this host has). Prints the table
of `tools.collective_table` and writes `allgather_matmul_bench.json` and
`allgather_matmul_bench.png` to `--out_dir` (a relative one is relative to where
the command ran, under `bazel run` too) and prints where. Needs Hopper GPUs.
"""

from __future__ import annotations

import os

from absl import flags

from tools import cli, collective_table, launch, report

_DEVICE_COUNTS = flags.DEFINE_list("device_counts", ["2", "4", "8"], "Ring sizes.")
_M_SHARD = flags.DEFINE_integer("m_shard", 1024, "LHS rows per device.", lower_bound=1)
_K = flags.DEFINE_integer("k", 4096, "Contraction size.", lower_bound=1)
_N_SHARD = flags.DEFINE_integer("n_shard", 4096, "RHS columns per device.", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "float16", ["float16", "bfloat16"], "Operand dtype.")
_OP = flags.DEFINE_enum(
    "op", "all_gather", list(collective_table.OPS),
    "all_gather: all_gather_matmul (per device lhs (M_shard, K), rhs (K, N_shard)); "
    "reduce_scatter: matmul_reduce_scatter (per device lhs (D * M_shard, K), rhs "
    "(K, N_shard): --k is K_shard, --n_shard all of N, --m_shard the rows of one "
    "output block).")
_CONFIGS = flags.DEFINE_multi_string("config", [""], "TuningConfig fields (repeat to compare); "
                                     "empty: the matmul heuristic.")
_ITERATIONS = flags.DEFINE_integer("iterations", 50, "Timed runs per measurement.", lower_bound=1)
_OUT_DIR = flags.DEFINE_string("out_dir", os.environ.get("OUT", "out"),
                               "Where results go; relative to where the command ran.")


def plot(rows: list[dict], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  counts = sorted({r["devices"] for r in rows})
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for label, key in (("all-gather matmul", "kernel_util"), ("lower bound", "lower_bound_util"),
                     ("NCCL all-gather + cuBLAS", "baseline_util")):
    for config in sorted({r["config"] for r in rows}):
      points = [(r["devices"], 100 * r[key]) for r in rows if r["config"] == config and key in r]
      suffix = f" [{config}]" if len({r["config"] for r in rows}) > 1 else ""
      ax.plot(*zip(*points, strict=True), marker="o", label=label + suffix)
  ax.set_xticks(counts)
  ax.set_xlabel("GPUs")
  ax.set_ylabel("tensor-core utilization, %")
  ax.set_title("all-gather matmul (per-device problem "
               f"{rows[0]['m_shard']}x{rows[0]['k']}x{rows[0]['n_shard']} {rows[0]['dtype']})")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  gpus = launch.gpu_count()
  if not gpus:
    raise SystemExit("bench_allgather_matmul needs Hopper GPUs; nvidia-smi lists none. "
                     "`bazel run //examples:allgather_matmul` runs the portable path on CPU.")
  out_dir = cli.output_dir(_OUT_DIR.value)
  problem = collective_table.LocalProblem(m_shard=_M_SHARD.value, k=_K.value,
                                          n_shard=_N_SHARD.value, dtype=_DTYPE.value,
                                          op=_OP.value)
  rows = []
  for config in _CONFIGS.value:
    rows += collective_table.measure_rows([int(c) for c in _DEVICE_COUNTS.value], problem,
                                          host_gpus=gpus, config_text=config,
                                          iterations=_ITERATIONS.value)
  report.print_table(rows, ("op", "config") + collective_table.COLUMNS)
  stem = {"all_gather": "allgather_matmul", "reduce_scatter": "matmul_reducescatter"}[_OP.value]
  json_path, png_path = (os.path.join(out_dir, f"{stem}_bench.{ext}") for ext in ("json", "png"))
  report.write_json(json_path, rows)
  if rows:
    report.write_plot(plot, rows, png_path)
  cli.say_written([json_path, png_path])


if __name__ == "__main__":
  cli.run(main)
