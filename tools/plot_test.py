"""The benchmarks' plots, drawn from synthetic records (no GPU).

`report.write_plot` prints a line instead of failing where matplotlib is missing; these tests
import matplotlib first, so a lock file without it fails here instead of silently writing no
PNG.
"""

import importlib
import os

from absl import flags
from absl.testing import absltest

from tools import bench_matmul, report


def _import_benchmark(name: str):
  """Imports `tools.<name>` after bench_matmul: both define flags such as --iterations and
  --out_dir, which absl refuses twice in one process; plot() reads none of them."""
  for flag in flags.FLAGS.get_key_flags_for_module(bench_matmul):
    if flag.name in flags.FLAGS:
      delattr(flags.FLAGS, flag.name)
  return importlib.import_module(f"tools.{name}")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def matmul_records() -> list[dict]:
  """Records as bench_matmul.bench_problem returns them, one of them a failed kernel."""
  records = []
  for shape, dtype in (("4096x4096x4096", "float16"), ("1024x4096x4096", "bfloat16")):
    for kernel, tflops in (("jnp.dot", 760.0), ("ours: warp-specialized", 790.0)):
      records.append(dict(kernel=kernel, shape=shape, dtype=dtype, layout="NN", tflops=tflops,
                          median_us=180.0, ratio_to_dot=tflops / 760.0))
  records.append(dict(kernel="ours: pipelined", shape="4096x4096x4096", dtype="float16",
                      layout="NN", error="ValueError: synthetic"))
  return records


def allgather_rows() -> list[dict]:
  """Rows as collective_table.measure_rows returns them, for 2, 4 and 8 devices."""
  return [dict(devices=d, config="", m_shard=1024, k=4096, n_shard=4096, dtype="float16",
               kernel_util=0.7, lower_bound_util=0.9, baseline_util=0.55) for d in (2, 4, 8)]


class PlotTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    import matplotlib  # Part of both lock files; the plots must not be skipped.

    print(f"matplotlib {matplotlib.__version__}")

  def assert_png(self, path: str):
    self.assertTrue(os.path.exists(path), f"{path} was not written")
    with open(path, "rb") as f:
      self.assertEqual(f.read(len(PNG_MAGIC)), PNG_MAGIC, f"{path} is not a PNG")
    self.assertGreater(os.path.getsize(path), 1000)

  def test_matmul_plot(self):
    path = os.path.join(self.create_tempdir().full_path, "matmul_bench.png")
    report.write_plot(bench_matmul.plot, matmul_records(), path)
    self.assert_png(path)

  def test_models_suite_plot_is_a_panel_per_half(self):
    records = [dict(r, half=half) for half in ("fit", "check") for r in matmul_records()]
    path = os.path.join(self.create_tempdir().full_path, "matmul_bench.png")
    report.write_plot(bench_matmul.plot, records, path)
    self.assert_png(path)

  def test_allgather_matmul_plot(self):
    path = os.path.join(self.create_tempdir().full_path, "allgather_matmul_bench.png")
    report.write_plot(_import_benchmark("bench_allgather_matmul").plot, allgather_rows(), path)
    self.assert_png(path)


if __name__ == "__main__":
  absltest.main()
