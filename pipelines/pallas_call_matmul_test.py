"""The `pl.pallas_call` compatibility path: same numbers as the emit_pipeline kernel.

On a GPU it compiles with Mosaic GPU; on CPU (interpret) the same kernel body
runs in Pallas' generic interpreter.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from core import interpret, testing
from pipelines import (
    Epilogue,
    PipelinedConfig,
    matmul_reference,
    pallas_call_matmul,
    pipelined_matmul,
)
from pipelines import matmul_test_base as base

S = jax.ShapeDtypeStruct


def traced_pallas_call(fn, *args):
  """The `pallas_call` of `fn(*args)` as Pallas' generic interpreter gets it:
  (grid, block shapes of lhs, rhs and out, `plgpu.CompilerParams`)."""
  with interpret.interpret_mode(detect_races=False):
    # A fresh function: `make_jaxpr` goes through `jax.jit`, whose cache would
    # otherwise hand this trace to a later caller outside interpret mode.
    jaxpr = jax.make_jaxpr(lambda *operands: fn(*operands))(*args)
  calls = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "pallas_call"]
  if len(calls) != 1:
    raise AssertionError(f"expected one pallas_call, found {len(calls)} in {jaxpr}")
  (call,) = calls
  grid_mapping = call.params["grid_mapping"]
  blocks = tuple(bm.ref_aval.shape for bm in grid_mapping.block_mappings)
  return grid_mapping.grid, blocks, call.params["compiler_params"]


class PallasCallBaseCasesTest(base.MatmulTestBase):
  """The cases every matmul passes, on whole 64x64 tiles: this path takes no
  epilogue, no ragged edges and no K off the K tile."""

  supports_epilogue = False
  supports_ragged = False
  supports_k_padding = False
  tiled_by_config = False
  supports_layouts = False

  def run_matmul(self, lhs, rhs, bias=None, *, epilogue=Epilogue(), out_dtype=None):
    if bias is not None or epilogue != Epilogue():
      raise AssertionError("pallas_call_matmul has no epilogue; the base must not ask for one")
    config = PipelinedConfig(tile_m=64, tile_n=64, max_concurrent_steps=2)
    return pallas_call_matmul(lhs, rhs, config=config, out_dtype=out_dtype)


class PallasCallMatmulTest(testing.KernelTestCase):

  @parameterized.product(dtype=[jnp.float16, jnp.bfloat16], delay_release=[0, 1])
  def test_same_result_as_emit_pipeline(self, dtype, delay_release):
    m, k, n = (1024, 2048, 512) if self.backend == testing.GPU else (128, 256, 128)
    lhs = testing.random_array(0, (m, k), dtype)
    rhs = testing.random_array(1, (k, n), dtype)
    config = PipelinedConfig(tile_m=64, tile_n=64, max_concurrent_steps=3,
                             delay_release=delay_release)
    out = self.run_kernel(pallas_call_matmul, lhs, rhs, config=config)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=dtype)
    self.assert_close(out, pipelined_matmul(lhs, rhs, config=config), dtype=dtype,
                      tolerance=1e-3)

  def test_float32_output(self):
    lhs = testing.random_array(4, (128, 128), jnp.bfloat16)
    rhs = testing.random_array(5, (128, 64), jnp.bfloat16)
    config = PipelinedConfig(tile_m=64, tile_n=64, max_concurrent_steps=2)
    out = self.run_kernel(pallas_call_matmul, lhs, rhs, config=config, out_dtype=jnp.float32)
    self.assertEqual(out.dtype, jnp.float32)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.bfloat16)

  def test_without_a_sequential_dimension_nothing_is_pipelined(self):
    m, k, n = 128, 256, 128
    lhs = testing.random_array(2, (m, k), jnp.float16)
    rhs = testing.random_array(3, (k, n), jnp.float16)
    config = PipelinedConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=3)
    pipelined = functools.partial(pallas_call_matmul, config=config)
    all_parallel = functools.partial(pallas_call_matmul, config=config, all_parallel=True)

    # The default: K is a sequential grid dimension of K / tile_k = 4 steps,
    # pipelined through max_concurrent_steps = 3 slots of (64, 64) blocks.
    grid, blocks, params = traced_pallas_call(pipelined, lhs, rhs)
    self.assertEqual(grid, (2, 2, 4))
    self.assertEqual(blocks, ((64, 64), (64, 64), (64, 64)))
    self.assertEqual(params.dimension_semantics, ("parallel", "parallel", "sequential"))
    self.assertEqual(params.max_concurrent_steps, 3)

    # All parallel: one K step per block, which loads the whole K range, and
    # a pipeline of depth one, i.e. no pipelining.
    grid, blocks, params = traced_pallas_call(all_parallel, lhs, rhs)
    self.assertEqual(grid, (2, 2, 1))
    self.assertEqual(blocks, ((64, k), (k, 64), (64, 64)))
    self.assertEqual(params.dimension_semantics, ("parallel",) * 3)
    self.assertEqual(params.max_concurrent_steps, 1)

    # What Mosaic GPU allocates when it compiles each (lowered on CPU): the
    # SMEM of that many slots of those blocks.
    args = S((m, k), jnp.float16), S((k, n), jnp.float16)
    whole_k = PipelinedConfig(tile_m=64, tile_n=64, tile_k=k, max_concurrent_steps=1,
                              delay_release=0)
    for fn, model in ((pipelined, config), (all_parallel, whole_k)):
      self.assertEqual(testing.mosaic_smem_bytes(fn, *args),
                       model.pallas_call_smem_budget(k, jnp.float16, jnp.float16).total_bytes)

    # And the same numbers.
    out = self.run_kernel(all_parallel, lhs, rhs)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)

  def test_empty_k_without_a_sequential_dimension(self):
    # One K step of the whole K, where K = 0, is no step: zeros, as jnp.dot gives.
    lhs, rhs = jnp.ones((64, 0), jnp.float16), jnp.ones((0, 64), jnp.float16)
    out = pallas_call_matmul(lhs, rhs, config=PipelinedConfig(tile_m=64, tile_n=64),
                             all_parallel=True)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((64, 64), np.float16))


if __name__ == "__main__":
  absltest.main()
