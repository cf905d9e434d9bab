"""The training benchmark's main path at a tiny size, with its timer stubbed.

CUPTI needs a GPU, so `bench_train.measure_calls` is replaced by a fake that
gives each program its own made-up kernel times; everything else runs: the
parameters, the float32 reference, every pass of every implementation (in
Mosaic GPU interpret mode on CPU, race detection on; on a Hopper GPU for the
`_gpu` twin), the precision columns, the ratios, the JSON and the plot.
"""

import json
import math
import os
import sys
from unittest import mock

from absl.testing import absltest, flagsaver

import pipelines
from core import testing
from tools import bench_train

# Layers whose "ours" needs pipelines.gated_linear_unit.
GATED_LAYERS = ("glu", "mlp")
GRADIENTS = {"linear": ("d_x", "d_w"), "bias_gelu": ("d_x", "d_w", "d_b"),
             "bias_silu": ("d_x", "d_w", "d_b"), "glu": ("d_x", "d_w_gate", "d_w_up"),
             "mlp": ("d_x", "d_w_gate", "d_w_up", "d_w_down")}
# Loose: the bfloat16 model's error against float32 is about 1e-3 to 1e-2 here;
# this only catches a wrong comparison (a NaN, a transposed gradient).
ERROR_BOUND = 5e-2


class FakeCupti:
  """`measure_calls` with fixed kernel times: the n-th program measured takes
  100 * n us, split between two kernels."""

  def __init__(self):
    self.programs = {}

  def __call__(self, jitted, args, iterations):
    del args
    n = self.programs.setdefault(id(jitted), len(self.programs) + 1)
    return [[("fake_gemm", 90.0 * n), ("fake_fusion", 10.0 * n)] for _ in range(iterations)]


class BenchTrainTest(testing.KernelTestCase):

  def run_quick(self) -> dict:
    out_dir = self.create_tempdir().full_path
    with flagsaver.flagsaver(quick=True, out_dir=out_dir), \
        mock.patch.object(bench_train, "measure_calls", FakeCupti()):
      bench_train.main([])
    if self.backend == testing.INTERPRET:
      racy = [i for i, state in enumerate(self.kernel_race_states) if state.races_found]
      self.assertFalse(racy, f"race detector flagged kernel(s) {racy}")
    self.assertTrue(os.path.exists(os.path.join(out_dir, "train_bench.png")))
    with open(os.path.join(out_dir, "train_bench.json")) as f:
      return json.load(f)

  def test_quick_run_times_every_pass_and_computes_the_errors(self):
    doc = self.run_quick()
    self.assertEqual(doc["baseline"], "xla")
    self.assertEqual((doc["iterations"], doc["rounds"]), (2, 2))
    self.assertIn("total", doc["elapsed_s"])
    records = {(r["layer"], r["pass"], r["impl"]): r for r in doc["records"]}
    self.assertLen(records, len(doc["records"]), "one record per layer, pass and impl")
    has_glu = hasattr(pipelines, "gated_linear_unit")
    for layer in bench_train.DEFAULT_LAYERS:
      for pass_name in bench_train.PASSES:
        for impl in ("xla", "ours"):
          with self.subTest(layer=layer, pass_name=pass_name, impl=impl):
            record = records[(layer, pass_name, impl)]
            self.assertEqual(record["size"], "tiny@128")
            if impl == "ours" and layer in GATED_LAYERS and not has_glu:
              self.assertIn("gated_linear_unit", record["skipped"])
              continue
            self.assertNotIn("error", record)
            self.check_timed(record, records[(layer, pass_name, "xla")])
            self.check_errors(record, layer, pass_name)
        # tokamax is not in the lock files: absent (skipped) or, off a GPU, failing.
        tokamax = records[(layer, pass_name, "tokamax")]
        self.assertTrue("skipped" in tokamax or "error" in tokamax or "rel_error" in tokamax)
    if not has_glu:
      self.assertTrue(any("gated_linear_unit" in note for note in doc["notes"]))

  def check_timed(self, record: dict, xla: dict):
    self.assertEqual(record["kernels"][0]["name"], "fake_gemm")
    self.assertLen(record["kernels"], 2)
    total = sum(k["median_us"] for k in record["kernels"])
    self.assertAlmostEqual(record["median_us"], total)
    self.assertLen(record["round_median_us"], 2)
    self.assertLen(record["call_us"][0], 2)
    # Each program's fake time differs, so the ratio shows which way it is taken.
    self.assertAlmostEqual(record["ratio_to_xla"], xla["median_us"] / record["median_us"])
    self.assertGreater(record["tflops"], 0)
    self.assertGreater(record["model_flops"], 0)

  def check_errors(self, record: dict, layer: str, pass_name: str):
    expected = {"forward": ("out",), "backward": GRADIENTS[layer],
                "forward_backward": ("out", *GRADIENTS[layer])}[pass_name]
    self.assertEqual(tuple(record["rel_error"]), expected)
    for name, error in record["rel_error"].items():
      self.assertTrue(math.isfinite(error) and 0 < error < ERROR_BOUND, f"{name}: {error}")
    self.assertEqual(record["rel_error_max"], max(record["rel_error"].values()))


class SkipTest(absltest.TestCase):

  def test_a_peer_that_does_not_import_is_skipped_with_a_note(self):
    size = bench_train.parse_size("tiny@128")
    # None in sys.modules makes `import tokamax` raise ImportError.
    with mock.patch.dict(sys.modules, {"tokamax": None}), \
        mock.patch.object(bench_train, "measure_calls", FakeCupti()):
      records, notes = bench_train.bench_layer(
          bench_train.parse_layer("glu"), size, impl_names=["xla", "tokamax"],
          pass_names=["forward"], iterations=1, rounds=1)
    by_impl = {r["impl"]: r for r in records}
    self.assertIn("tokamax is not importable", by_impl["tokamax"]["skipped"])
    self.assertIn("rel_error", by_impl["xla"])
    self.assertLen(notes, 1)
    self.assertTrue(notes[0].startswith("glu tiny@128: tokamax skipped: tokamax is not "
                                        "importable (ModuleNotFoundError"), notes)

  def test_parsing(self):
    self.assertEqual(bench_train.parse_size("qwen2.5-7b@8192").model.intermediate, 18944)
    self.assertEqual(bench_train.parse_layer("glu_gelu").activation, "gelu")
    self.assertIsNone(bench_train.parse_layer("mlp").activation)
    for bad in ("gpt@1", "llama3-8b", "llama3-8b@0"):
      with self.assertRaises(ValueError):
        bench_train.parse_size(bad)
    for bad in ("bias", "linear_gelu", "glu_relu", "conv"):
      with self.assertRaises(ValueError):
        bench_train.parse_layer(bad)


if __name__ == "__main__":
  absltest.main()
