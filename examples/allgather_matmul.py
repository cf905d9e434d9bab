"""The all-gather matmul, checked and timed: the project's main job.

    bazel run //examples:allgather_matmul
    bazel run //examples:allgather_matmul -- --device_counts=2,4,8 --m_shard=1024 --k=4096

On Hopper GPUs it runs the Mosaic ring kernel (`collectives.all_gather_matmul`;
one GPU takes the plain warp-specialized matmul; where the ring cannot run,
as with one process per GPU and no NVSHMEM, NCCL all-gather + one dot), checks
it against a float32 reference, and prints one row per device count: kernel
time and tensor-core utilization, the lower bound (D x the single-GPU matmul
of the local shard, plus a latency per communication round), and NCCL
all-gather + cuBLAS.

With no GPU it runs the portable XLA ring on simulated CPU devices (8 unless
XLA_FLAGS says otherwise), at smaller default shapes, and says so. Under
`tools.launch` (several processes) it runs one row over every device of the job.
The exit status is non-zero if any result is wrong.
"""

from __future__ import annotations

import os

# Simulated CPU devices must be requested before JAX starts; the flag has no
# effect on GPUs.
SIMULATED_CPU_DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={SIMULATED_CPU_DEVICES}").strip()

import sys  # noqa: E402 - after the XLA_FLAGS set-up above.

from absl import app, flags  # noqa: E402

from tools import collective_table, launch, report  # noqa: E402

# Defaults: the reference results' problem on GPUs, a quick one on CPU.
GPU_PROBLEM = collective_table.LocalProblem(m_shard=1024, k=4096, n_shard=4096)
CPU_PROBLEM = collective_table.LocalProblem(m_shard=128, k=256, n_shard=256)

_DEVICE_COUNTS = flags.DEFINE_list("device_counts", None,
                                   "Ring sizes; default: 1, 2, 4, 8 up to what the host has.")
_M_SHARD = flags.DEFINE_integer("m_shard", None, "LHS rows per device.")
_K = flags.DEFINE_integer("k", None, "Contraction size.")
_N_SHARD = flags.DEFINE_integer("n_shard", None, "RHS columns per device.")
_DTYPE = flags.DEFINE_enum("dtype", "float16", ["float16", "bfloat16"], "Operand dtype.")
_CONFIG = flags.DEFINE_string("config", "",
                              "TuningConfig fields, e.g. tile_m=64,tile_n=256,wg_dimension=M; "
                              "default: the matmul heuristic.")
_IMPLEMENTATION = flags.DEFINE_enum("implementation", "auto",
                                    ["auto", "mosaic", "xla_ring", "xla_all_gather"],
                                    "Force an implementation.")
_ITERATIONS = flags.DEFINE_integer("iterations", 50, "Timed runs per measurement (GPU).")
_JSON = flags.DEFINE_string("json", None, "Also write the rows to this JSON file.")


def main(argv):
  del argv
  launched = launch.initialize()
  gpus = launch.gpu_count()
  on_gpu = gpus > 0 and os.environ.get("JAX_PLATFORMS") != "cpu"
  default = GPU_PROBLEM if on_gpu else CPU_PROBLEM
  problem = collective_table.LocalProblem(
      m_shard=_M_SHARD.value or default.m_shard, k=_K.value or default.k,
      n_shard=_N_SHARD.value or default.n_shard, dtype=_DTYPE.value)
  if launched:
    import jax  # noqa: PLC0415 - only after jax.distributed joined the job.

    counts = [jax.device_count()]
    print(f"process {jax.process_index()} of {jax.process_count()}: one row over all "
          f"{jax.device_count()} devices of the job")
  else:
    available = gpus if on_gpu else SIMULATED_CPU_DEVICES
    counts = ([int(c) for c in _DEVICE_COUNTS.value] if _DEVICE_COUNTS.value
              else [c for c in (1, 2, 4, 8) if c <= available])
  if on_gpu:
    print(f"{gpus} GPU(s) on this host: the Mosaic ring kernel where it can run")
  else:
    print("no GPU: the portable XLA ring (lax.ppermute + dot) on simulated CPU devices; "
          "times are CPU wall-clock and only show that it runs")
  print(f"local problem per device: lhs ({problem.m_shard}, {problem.k}) x rhs "
        f"({problem.k}, {problem.n_shard}) {problem.dtype}")
  rows = collective_table.measure_rows(counts, problem,
                                       host_gpus=gpus if on_gpu and not launched else 0,
                                       config_text=_CONFIG.value,
                                       implementation=_IMPLEMENTATION.value,
                                       iterations=_ITERATIONS.value)
  report.print_table(rows, collective_table.COLUMNS)
  if _JSON.value:
    report.write_json(_JSON.value, rows)
  wrong = [r["devices"] for r in rows if not r["correct"]]
  if wrong or not rows:
    print(f"FAILED: wrong results for device counts {wrong}" if wrong else "FAILED: no rows")
    sys.exit(1)
  print("allgather_matmul: all results match the float32 reference")


if __name__ == "__main__":
  app.run(main)
