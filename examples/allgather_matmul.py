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
XLA_FLAGS says otherwise), at smaller default shapes, and says so; with
`--implementation=mosaic` it runs the Mosaic ring kernel itself on 2 and 4
simulated devices, in Mosaic GPU's interpret mode extended with semaphores and
peer memory (the `simulator` package, with race detection across devices), at a
problem small enough to take seconds. Under `tools.launch` (several processes)
it runs one row over every device of the job. The exit status is non-zero if
any result is wrong or a race was found.
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

import contextlib  # noqa: E402 - after the XLA_FLAGS set-up above.
import sys  # noqa: E402

from absl import app, flags  # noqa: E402

from tools import cli, collective_table, launch, report  # noqa: E402

# Defaults: the reference results' problem on GPUs, a quick one on CPU.
GPU_PROBLEM = collective_table.LocalProblem(m_shard=1024, k=4096, n_shard=4096)
CPU_PROBLEM = collective_table.LocalProblem(m_shard=128, k=256, n_shard=256)
# The Mosaic ring on CPU runs every simulated GPU thread as a CPU thread: one
# M tile and one N tile of the ring's default config per device, and rings
# of 2 and 4 devices, take seconds.
SIMULATED_PROBLEM = collective_table.LocalProblem(m_shard=128, k=128, n_shard=64)
SIMULATED_DEVICE_COUNTS = (2, 4)
# Bounds a semaphore wait on a signal that never comes (a broken kernel).
SIMULATED_WAIT_TIMEOUT_S = 120.0
CPU_COLUMNS_NOTE = ("note: no GPU, so no kernel_util, lower_bound_us, lower_bound_util or "
                    "baseline_util: they need CUPTI kernel times and a GPU's peak rate")

_DEVICE_COUNTS = flags.DEFINE_list("device_counts", None,
                                   "Ring sizes; default: 1, 2, 4, 8 up to what the host has.")
_M_SHARD = flags.DEFINE_integer("m_shard", None, "LHS rows per device.", lower_bound=1)
_K = flags.DEFINE_integer("k", None, "Contraction size.", lower_bound=1)
_N_SHARD = flags.DEFINE_integer("n_shard", None, "RHS columns per device.", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "float16", ["float16", "bfloat16"], "Operand dtype.")
_CONFIG = flags.DEFINE_string("config", "",
                              "TuningConfig fields, e.g. tile_m=64,tile_n=256,wg_dimension=M; "
                              "default: the matmul heuristic.")
_IMPLEMENTATION = flags.DEFINE_enum("implementation", "auto",
                                    ["auto", "mosaic", "xla_ring", "xla_all_gather"],
                                    "Force an implementation.")
_ITERATIONS = flags.DEFINE_integer("iterations", 50, "Timed runs per measurement (GPU).",
                                   lower_bound=1)
_JSON = flags.DEFINE_string("json", None, "Also write the rows to this JSON file "
                            "(relative to where the command ran).")


def _simulated_ring():
  """The collective interpreter around the rows, and a check for races after them.

  Returns (the context to measure in, a function that says whether a race was found).
  """
  # Test support, imported only here: it must size XLA's CPU thread pool before
  # jax starts its CPU backend, which nothing before this line has done.
  import simulator  # noqa: PLC0415
  from core import interpret  # noqa: PLC0415

  simulator.reserve_intra_op_threads()
  mode = simulator.collective_interpret_mode(wait_timeout_s=SIMULATED_WAIT_TIMEOUT_S)
  return mode, interpret.races_found


def main(argv):
  del argv
  gpus = launch.gpu_count()
  on_gpu = gpus > 0 and os.environ.get("JAX_PLATFORMS") != "cpu"
  simulate = not on_gpu and _IMPLEMENTATION.value == "mosaic"
  if simulate and launch.NUM_PROCESSES_ENV in os.environ:
    raise app.UsageError("--implementation=mosaic without a GPU simulates the ring's devices "
                         "in one process; run it without tools.launch")
  mode, races_found = _simulated_ring() if simulate else (contextlib.nullcontext(), None)
  launched = launch.initialize()
  default = GPU_PROBLEM if on_gpu else SIMULATED_PROBLEM if simulate else CPU_PROBLEM
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
    default_counts = SIMULATED_DEVICE_COUNTS if simulate else (1, 2, 4, 8)
    counts = ([int(c) for c in _DEVICE_COUNTS.value] if _DEVICE_COUNTS.value
              else [c for c in default_counts if c <= available])
  if on_gpu:
    print(f"{gpus} GPU(s) on this host: the Mosaic ring kernel where it can run")
  elif simulate:
    print("no GPU: the Mosaic ring kernel in Mosaic GPU's interpret mode with simulated "
          "semaphores and peer memory (the simulator package), race detection on, on "
          f"{', '.join(map(str, counts))} simulated CPU devices; times are CPU wall-clock "
          "and only show that it runs")
  else:
    print("no GPU: the portable XLA ring (lax.ppermute + dot) on simulated CPU devices; "
          "times are CPU wall-clock and only show that it runs")
  print(f"local problem per device: lhs ({problem.m_shard}, {problem.k}) x rhs "
        f"({problem.k}, {problem.n_shard}) {problem.dtype}")
  with mode:
    rows = collective_table.measure_rows(counts, problem,
                                         host_gpus=gpus if on_gpu and not launched else 0,
                                         config_text=_CONFIG.value,
                                         implementation=_IMPLEMENTATION.value,
                                         iterations=_ITERATIONS.value)
  report.print_table(rows, collective_table.COLUMNS)
  if not on_gpu:
    print(CPU_COLUMNS_NOTE)
  if _JSON.value:
    path = cli.user_path(_JSON.value)
    report.write_json(path, rows)
    cli.say_written([path])
  wrong = [r["devices"] for r in rows if not r["correct"]]
  if wrong or not rows:
    print(f"FAILED: wrong results for device counts {wrong}" if wrong else "FAILED: no rows")
    sys.exit(1)
  if races_found is not None:
    if races_found():
      print("FAILED: the race detector reported a race between simulated devices (see above)")
      sys.exit(1)
    print("race detection: no race between the simulated devices")
  print("allgather_matmul: all results match the float32 reference")


if __name__ == "__main__":
  cli.run(main)
