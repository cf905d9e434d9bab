"""bench_fp8's problems, and that every implementation it times computes the
product it names (interpret mode on CPU)."""

import jax
import jax.numpy as jnp
from absl.testing import absltest, flagsaver, parameterized

import simulator
from core import testing
from core.numerics import relative_error
from pipelines import dequantize_fp8
from pipelines.fp8_quantize import ROW_BLOCK, SQUARE_BLOCK
from tools import bench_fp8 as bench

# The persistent FP8 kernel's warpgroups block on each other's barriers, each on
# a thread of XLA's intra-op pool (`simulator.thread_pool`).
simulator.reserve_intra_op_threads()

# Every FP8 path rounds both operands to e4m3 (3 mantissa bits).
FP8_TOLERANCE = 0.06


class ProblemsTest(absltest.TestCase):

  def test_model_shapes_with_many_rows(self):
    problems = bench.default_problems(1024)
    self.assertGreaterEqual(len(problems), 10)
    self.assertTrue(all(m >= 1024 for m, _, _ in problems))
    self.assertIn((8192, 8192, 8192), problems)

  def test_a_bad_shape_fails_before_anything_runs(self):
    # Checked before the GPU is looked for, so a typo fails on any machine.
    with flagsaver.flagsaver(shapes=["4096x4096"]), \
        self.assertRaisesRegex(ValueError, "shape '4096x4096' must be 3 positive integers"):
      bench.main([])


class ImplementationsTest(testing.KernelTestCase):

  def test_each_forward_is_the_product(self):
    x, w = (testing.random_array(1, (128, 256), jnp.bfloat16),
            testing.random_array(2, (256, 128), jnp.bfloat16))
    exact = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
    impls, operands = bench.forward_implementations(x, w)
    self.assertLen(impls, 10)
    for name, fn in impls.items():
      out = self.run_kernel(jax.jit(fn), operands)
      self.assertEqual((out.shape, out.dtype), (exact.shape, jnp.dtype(jnp.bfloat16)), name)
      self.assertLess(relative_error(out, exact), FP8_TOLERANCE, name)

  @parameterized.parameters((ROW_BLOCK,), (SQUARE_BLOCK,))
  def test_both_layouts_as_xla_quantizes_them(self, block):
    a = testing.random_array(10, (256, 384), jnp.bfloat16)
    impls = bench.both_layouts_implementations(block)
    self.assertLen(impls, 2)
    want = jax.tree.leaves(impls[bench.BOTH_LAYOUTS_BASELINE](a))
    for name, fn in impls.items():
      got = jax.tree.leaves(self.run_kernel(jax.jit(fn), a))
      for g, w in zip(got, want, strict=True):
        self.assertEqual(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))),
                         0.0, name)

  @parameterized.product(block=[ROW_BLOCK, SQUARE_BLOCK], transpose=[False, True])
  def test_one_layout_as_xla_quantizes_it(self, block, transpose):
    a = testing.random_array(11, (256, 384), jnp.bfloat16)
    impls = bench.one_layout_implementations(block, transpose)
    self.assertLen(impls, 2)
    want = impls[bench.ONE_LAYOUT_BASELINE](a)
    for name, fn in impls.items():
      got = self.run_kernel(jax.jit(fn), a)
      for g, w in zip(got, want, strict=True):
        self.assertEqual(g.shape, w.shape, name)
        self.assertEqual(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))),
                         0.0, name)

  def test_each_quantized_output_is_the_quantized_product(self):
    """(values, scales) in (1, 128) blocks of x @ w: each dequantized within
    e4m3's rounding of the product."""
    x, w = (testing.random_array(8, (128, 256), jnp.bfloat16),
            testing.random_array(9, (256, 384), jnp.bfloat16))
    exact = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
    impls = bench.quantized_output_implementations()
    self.assertLen(impls, 3)
    for name, fn in impls.items():
      values, scales = self.run_kernel(jax.jit(fn), x, w)
      self.assertEqual((values.dtype, scales.shape), (jnp.dtype(jnp.float8_e4m3fn), (128, 3)),
                       name)
      self.assertLess(relative_error(dequantize_fp8(values, scales), exact), FP8_TOLERANCE,
                      name)

  def test_xla_per_tensor_multiplies_the_e4m3_operands(self):
    """XLA makes an FP8 GEMM of a dot whose operands are e4m3; operands
    converted to bf16 first became a bf16 GEMM on the H200."""
    x, w = (testing.random_array(6, (128, 256), jnp.bfloat16),
            testing.random_array(7, (256, 128), jnp.bfloat16))
    impls, operands = bench.forward_implementations(x, w)
    text = jax.jit(impls["xla: fp8 per-tensor"]).lower(operands).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    self.assertTrue(dots)
    self.assertTrue(all("f8E4M3FN" in line for line in dots), dots)

  def test_dequantized_path_is_a_bf16_dot(self):
    """The dequantize-then-bf16 path's dot writes bf16, as `jnp.dot` would:
    a float32 output made it slower than what a user runs."""
    x, w = (testing.random_array(6, (128, 256), jnp.bfloat16),
            testing.random_array(7, (256, 128), jnp.bfloat16))
    impls, operands = bench.forward_implementations(x, w)
    self.assertEqual(testing.dot_dtypes(impls["xla: dequantize + bf16"], operands),
                     [(jnp.bfloat16,) * 3])

  def test_each_training_step_has_the_gradients(self):
    x, w = (testing.random_array(3, (64, 128), jnp.bfloat16),
            testing.random_array(4, (128, 128), jnp.bfloat16))
    g = testing.random_array(5, (64, 128), jnp.bfloat16)
    want = [x.astype(jnp.float32) @ w.astype(jnp.float32),
            g.astype(jnp.float32) @ w.astype(jnp.float32).T,
            x.astype(jnp.float32).T @ g.astype(jnp.float32)]
    for name, fn in bench.train_implementations().items():
      got = self.run_kernel(jax.jit(fn), x, w, g)
      for part, (a, b) in zip(("out", "d x", "d w"), zip(got, want, strict=True), strict=True):
        self.assertLess(relative_error(a, b), FP8_TOLERANCE, f"{name}: {part}")


class PrecisionTest(testing.KernelTestCase):

  def test_kernels_error_is_small_against_the_dequantized_product(self):
    records = bench.precision_records([256], m=64, n=128)
    self.assertLen(records, 6)
    for r in records:
      self.assertLess(r["rel_error"], 1e-2, r["kernel"])
      self.assertLess(r["magnitude_error"], 1e-2, r["kernel"])


if __name__ == "__main__":
  absltest.main()
