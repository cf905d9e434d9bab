"""`matmul` with its output quantized to e4m3 in the epilogue, in interpret mode and on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from core import testing
from pipelines import (
  Epilogue,
  MatmulDimension,
  TuningConfig,
  dequantize_fp8,
  fp8_matmul,
  kernel_call,
  matmul,
  matmul_reference,
  operands,
  quantize_fp8_reference,
)
from pipelines import matmul_test_base as base
from pipelines.fp8_quantize import ROW_BLOCK, SQUARE_BLOCK, scales_shape
from pipelines.heuristic import quantized_output_config
from pipelines.operands import MatmulProblem

# e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2**-4
# of itself, a subnormal one by half the smallest step, 2**-10 of the scale.
E4M3_RELATIVE_ROUNDING = 2.0**-4
E4M3_SUBNORMAL_ROUNDING = 2.0**-10
# The float32 sums of 16-bit products differ from the float32 reference's by
# summation order only: far below this share of a block's largest magnitude.
SUMMATION_TOLERANCE = 1e-4
# And each element by at most this share of its products' magnitudes (times
# gelu's and silu's steepest slope, 1.13): where the reference is near a
# rounding boundary of e4m3, that difference can round the value the other
# way. On an H200 at 2048x4096x3000, 2 of 6.1 million elements exceeded the
# bound without this term, by at most 4.2e-5 (1.6e-8 of their magnitudes).
SUMMATION_OF_MAGNITUDES = 1.13 * 2.0**-20
F8 = jnp.float8_e4m3fn


class QuantizedOutputTest(testing.KernelTestCase):

  def check(self, m, k, n, *, seed, layout=base.NN, epilogue=Epilogue(), config=None):
    """The output in (1, 128) blocks: each block's scale the one
    `quantize_fp8` gives the float32 reference's block, and each value within
    e4m3's rounding of the reference once multiplied by it."""
    lhs, rhs = base.operands(seed, m, k, n, jnp.bfloat16, layout)
    bias = testing.random_array(seed + 2, (n,), jnp.float32) if epilogue.has_bias else None
    values, scales = self.run_kernel(
        matmul, lhs, rhs, bias, activation=epilogue.activation, out_dtype=F8,
        transpose_lhs=layout.transpose_lhs, transpose_rhs=layout.transpose_rhs, config=config)
    ref = matmul_reference(lhs, rhs, bias, epilogue=epilogue, layout=layout)
    self.assertEqual((values.shape, values.dtype), ((m, n), jnp.dtype(F8)))
    self.assertEqual((scales.shape, scales.dtype),
                     (scales_shape((m, n), ROW_BLOCK), jnp.dtype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(scales),
                               np.asarray(quantize_fp8_reference(ref, ROW_BLOCK)[1]),
                               rtol=SUMMATION_TOLERANCE)
    ref = np.asarray(ref)
    scale_of_each = np.asarray(dequantize_fp8(jnp.ones((m, n), F8), scales))
    magnitudes = np.asarray(matmul_reference(jnp.abs(lhs), jnp.abs(rhs), layout=layout))
    bound = ((E4M3_RELATIVE_ROUNDING + SUMMATION_TOLERANCE) * np.abs(ref)
             + (E4M3_SUBNORMAL_ROUNDING + SUMMATION_TOLERANCE) * scale_of_each
             + SUMMATION_OF_MAGNITUDES * magnitudes)
    error = np.abs(np.asarray(dequantize_fp8(values, scales)) - ref)
    # NaN (an element the kernel never wrote, on poisoned memory) fails too.
    self.assertTrue(np.all(error <= bound),
                    f"{np.count_nonzero(~(error <= bound))} of {error.size} elements outside "
                    f"the bound; worst excess {np.nanmax(error - bound):.3g}")
    return values, scales

  @parameterized.parameters(*base.LAYOUTS)
  def test_layouts_with_ragged_edges(self, layout):
    """M and N off the tiles (the last block of a row 44 columns wide)."""
    self.check(100, 200, 300, seed=70, layout=layout,
               epilogue=Epilogue(activation="gelu", has_bias=True))

  def test_short_k_under_a_transposed_lhs(self):
    """A K of one short step with a (K, M) LHS: the default config's K step."""
    self.check(64, 24, 50, seed=72, layout=base.LAYOUTS[2])

  @parameterized.parameters(
      # Warpgroups of 128 and 256 columns (a block's sub-tiles are the
      # warpgroup's 128-column epilogue tiles), and one pipeline stage short.
      dict(tile_n=128, max_concurrent_steps=3),
      dict(tile_n=256, max_concurrent_steps=2))
  def test_configs(self, **fields):
    config = TuningConfig(tile_m=64, wg_dimension=MatmulDimension.M, epi_tile_n=128, **fields)
    self.check(136, 320, 520, seed=71, config=config,
               epilogue=Epilogue(activation="silu", has_bias=True))

  def test_feeds_fp8_matmul(self):
    """The values and scales are what `fp8_matmul` takes as its LHS."""
    m, k, n = 128, 256, 256
    values, scales = self.check(m, k, n, seed=72)
    w = testing.random_array(74, (n, 64), jnp.bfloat16)
    rhs, rhs_scales = quantize_fp8_reference(w.T, SQUARE_BLOCK)
    out = self.run_kernel(fp8_matmul, values, rhs, scales, rhs_scales)
    want = dequantize_fp8(values, scales) @ dequantize_fp8(rhs, rhs_scales, SQUARE_BLOCK).T
    self.assertEqual(out.shape, (m, 64))
    self.assert_close(out, want, dtype=jnp.bfloat16)

  def test_batched_rows(self):
    """Under `jax.vmap` the batch of LHS rows is one kernel's rows, and the
    scales follow their rows."""
    lhs = testing.random_array(75, (3, 64, 256), jnp.bfloat16)
    rhs = testing.random_array(76, (256, 256), jnp.bfloat16)
    values, scales = self.run_kernel(jax.vmap(lambda a: matmul(a, rhs, out_dtype=F8)), lhs)
    self.assertEqual((values.shape, scales.shape), ((3, 64, 256), (3, 64, 2)))
    flat_values, flat_scales = matmul(lhs.reshape(192, 256), rhs, out_dtype=F8)
    np.testing.assert_array_equal(np.asarray(scales.reshape(192, 2)), np.asarray(flat_scales))
    np.testing.assert_array_equal(np.asarray(values.reshape(192, 256), np.float32),
                                  np.asarray(flat_values, np.float32))

  def test_lowers_for_the_gpu(self):
    """Mosaic GPU's own checks (the row reduction in the accumulator's
    layout, the e4m3 and scale stores) run when lowered for CUDA, on a CPU too."""
    lhs, rhs = base.operands(77, 100, 200, 300, jnp.bfloat16)
    text = testing.lowered_for_gpu(
        lambda a, b: matmul(a, b, activation="relu", out_dtype=F8), lhs, rhs)
    self.assertEqual(testing.mosaic_kernel_count(text), 1)

  def test_real_size(self):
    if self.backend != testing.GPU:
      self.skipTest("real sizes run on the GPU only (minutes in the interpreter)")
    self.check(2048, 4096, 3000, seed=78, epilogue=Epilogue(activation="gelu", has_bias=True))


class QuantizedOutputConfigTest(parameterized.TestCase):

  @parameterized.product(shape=[(1, 4096, 4096), (2048, 4096, 5120), (8192, 4096, 14336),
                                (100, 200, 300), (4096, 16, 4096), (64, 24, 50)],
                         layout=base.LAYOUTS)
  def test_config_can_quantize(self, shape, layout):
    """Cooperative, unsplit, warpgroups along M a multiple of 128 columns wide
    with 128-column epilogue tiles: each sub-tile row is one block; and a
    config the kernel runs (a K of 17-32 under a (K, M) LHS once got its
    narrower tiles' 32-element K step, which 128-column tiles cannot swizzle)."""
    m, k, n = shape
    problem = MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.bfloat16), layout=layout)
    with testing.facts_of_the_fitted_gpu():
      config = quantized_output_config(problem)
      kernel_call.check_ws_config(config, operands.pad_k(problem, config.tile_k), F8,
                                  has_bias=True)
    self.assertEqual((config.k_splits, config.cluster_m, config.epi_tile_n, config.wg_dimension),
                     (1, 1, 128, MatmulDimension.M))
    self.assertIn(config.tile_n, (128, 256))


class QuantizedOutputErrorsTest(parameterized.TestCase):

  def test_config_that_cannot_quantize(self):
    lhs, rhs = base.operands(79, 64, 128, 256, jnp.bfloat16)
    for config in (TuningConfig(epi_tile_n=64), TuningConfig(tile_n=128, k_splits=2,
                                                             epi_tile_n=128)):
      with self.assertRaisesRegex(ValueError, "quantized to float8_e4m3fn needs"), \
          base.no_kernel_built():
        matmul(lhs, rhs, out_dtype=F8, config=config)

  def test_not_differentiable(self):
    lhs, rhs = base.operands(80, 64, 128, 256, jnp.bfloat16)
    with self.assertRaisesRegex(TypeError, "not differentiable"):
      jax.grad(lambda a: matmul(a, rhs, out_dtype=F8)[1].sum())(lhs)


if __name__ == "__main__":
  absltest.main()
