"""The `pl.pallas_call` compatibility path: same numbers as the emit_pipeline kernel."""

import jax.numpy as jnp
from absl.testing import absltest, parameterized

from core import testing
from pipelines import PipelinedConfig, matmul_reference, pallas_call_matmul, pipelined_matmul


class PallasCallMatmulTest(testing.KernelTestCase):

  def setUp(self):
    super().setUp()
    if self.backend != testing.GPU:
      self.skipTest("jax 0.11.2's GPU interpreter cannot store into a wgmma accumulator "
                    "(ValueError: Accumulator shape (6,) does not match value shape), which "
                    "this path needs between K steps: GPU only")

  @parameterized.product(dtype=[jnp.float16, jnp.bfloat16], delay_release=[0, 1])
  def test_same_result_as_emit_pipeline(self, dtype, delay_release):
    m, k, n = (1024, 2048, 512) if self.backend == testing.GPU else (128, 256, 128)
    lhs = testing.random_array(0, (m, k), dtype)
    rhs = testing.random_array(1, (k, n), dtype)
    config = PipelinedConfig(tile_m=64, tile_n=64, max_concurrent_steps=3,
                             delay_release=delay_release)
    out = self.run_kernel(pallas_call_matmul, lhs, rhs, config=config, out_bytes=m * n * 2)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=dtype)
    self.assert_close(out, pipelined_matmul(lhs, rhs, config=config), dtype=dtype,
                      tolerance=1e-3)

  def test_without_a_sequential_dimension_nothing_is_pipelined(self):
    # All-parallel: every block loads its whole K range in one step. Same numbers.
    lhs = testing.random_array(2, (128, 128), jnp.float16)
    rhs = testing.random_array(3, (128, 128), jnp.float16)
    config = PipelinedConfig(tile_m=64, tile_n=64)
    out = self.run_kernel(pallas_call_matmul, lhs, rhs, config=config, all_parallel=True)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)


if __name__ == "__main__":
  absltest.main()
