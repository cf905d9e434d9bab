"""The quickstart kernels, on CPU (interpret mode) and on a Hopper GPU."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import interpret, testing
from examples import quickstart_kernels


class FillTest(testing.KernelTestCase):

  @parameterized.product(shape=[(128,), (8, 64), (4, 8, 32)],
                         dtype=[jnp.float32, jnp.bfloat16])
  def test_fills_every_element(self, shape, dtype):
    value = float(testing.random_array(sum(shape), (), jnp.float32))
    out = self.run_kernel(quickstart_kernels.fill, shape, value, dtype)
    self.assertEqual(out.shape, shape)
    self.assertEqual(out.dtype, dtype)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.full(shape, np.asarray(jnp.asarray(value, dtype), np.float32)))

  def test_rejects_bad_input_before_compiling(self):
    with self.assertRaisesRegex(ValueError, "dtype=int8"):
      quickstart_kernels.fill((128,), 1.0, jnp.int8)
    with self.assertRaisesRegex(ValueError, "multiple of 16 bytes"):
      quickstart_kernels.fill((3,), 1.0)
    with self.assertRaisesRegex(ValueError, "shared memory"):
      quickstart_kernels.fill((1024, 1024), 1.0)


class IotaTest(testing.KernelTestCase):

  @parameterized.product(length=[256, 1024, 3 * 512], block=[128, 256],
                         dtype=[jnp.int32, jnp.float32])
  def test_matches_arange(self, length, block, dtype):
    if length % block:
      self.skipTest(f"{length=} is not a multiple of {block=}")
    out = self.run_kernel(quickstart_kernels.iota, length, block=block, dtype=dtype)
    np.testing.assert_array_equal(np.asarray(out), np.arange(length, dtype=dtype))

  def test_rejects_length_not_multiple_of_block(self):
    with self.assertRaisesRegex(ValueError, "length=300 must be a positive multiple of block=256"):
      quickstart_kernels.iota(300)
    with self.assertRaisesRegex(ValueError, "block=100"):
      quickstart_kernels.iota(400, block=100)

  def test_poisoned_output_catches_an_unwritten_element(self):
    # A deliberately broken checker input: the comparison the tests rely on
    # must fail when one element was never written (still NaN).
    out = jnp.arange(256, dtype=jnp.float32).at[7].set(jnp.nan)
    self.assertEqual(testing.relative_error(out, jnp.arange(256.0)), float("inf"))

  def test_interpreter_poisons_outputs(self):
    if self.backend != testing.INTERPRET:
      self.skipTest("checks the interpreter's NaN-filled outputs")

    def half_kernel(out_gmem):  # Writes only the first half.
      out_gmem[pl.ds(0, 128)] = jnp.ones((128,), jnp.float32)

    kernel = plgpu.kernel(half_kernel, out_type=jax.ShapeDtypeStruct((256,), jnp.float32),
                          interpret=interpret.interpret_params())
    out = np.asarray(self.run_kernel(kernel))
    self.assertTrue(np.all(np.isnan(out[128:])), "unwritten elements must read as NaN")


if __name__ == "__main__":
  absltest.main()
