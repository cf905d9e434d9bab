"""The emit_pipeline matmul (`pipelined_matmul`), in interpret mode and on a GPU."""

import dataclasses

import jax.numpy as jnp
from absl.testing import absltest, parameterized

from core import testing
from pipelines import Epilogue, PipelinedConfig, matmul_reference, pipelined_matmul
from pipelines import matmul_test_base as base

SMALL_PIPELINED = PipelinedConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)


class PipelinedMatmulTest(base.MatmulTestBase):

  supports_epilogue = False
  supports_k_padding = False
  tiled_by_config = False
  supports_layouts = False

  def run_matmul(self, lhs, rhs, bias=None, *, epilogue=Epilogue(), out_dtype=None):
    if bias is not None or epilogue != Epilogue():
      raise AssertionError("pipelined_matmul has no epilogue; the base must not ask for one")
    return pipelined_matmul(lhs, rhs, config=SMALL_PIPELINED, out_dtype=out_dtype)

  @parameterized.product(delay_release=[0, 1], steps=[2, 3], out_dtype=[None, jnp.float32])
  def test_pipeline_knobs(self, delay_release, steps, out_dtype):
    if delay_release >= steps:
      self.skipTest("invalid combination, covered by the validation test")
    config = dataclasses.replace(SMALL_PIPELINED, delay_release=delay_release,
                                 max_concurrent_steps=steps)
    lhs, rhs = base.operands(1, 64, 256, 64, jnp.float16)
    out = self.run_kernel(pipelined_matmul, lhs, rhs, config=config, out_dtype=out_dtype)
    self.assertEqual(out.dtype, out_dtype or jnp.float16)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)

  def test_narrow_swizzle(self):
    """32-wide K and N tiles: both base.operands get the same 64-byte swizzle."""
    config = PipelinedConfig(tile_m=64, tile_n=32, tile_k=32, max_concurrent_steps=3)
    lhs, rhs = base.operands(3, 64, 128, 96, jnp.bfloat16)
    out = self.run_kernel(pipelined_matmul, lhs, rhs, config=config)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.bfloat16)

  def test_real_size(self):
    if self.backend != testing.GPU:
      self.skipTest("real sizes run on the GPU only (minutes in the interpreter)")
    lhs, rhs = base.operands(2, 4096, 4096, 4096, jnp.float16)
    for config in (PipelinedConfig(), PipelinedConfig(tile_n=192, max_concurrent_steps=3)):
      out = self.run_kernel(pipelined_matmul, lhs, rhs, config=config)
      self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)


if __name__ == "__main__":
  absltest.main()
