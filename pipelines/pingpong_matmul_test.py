"""The ping-pong schedule of `ws_matmul`, in interpret mode and on a GPU.

The interpreter runs wgmma synchronously and ignores `wgmma_wait`, so
releasing a slot while a wgmma still reads it can only fail on a GPU
(`test_real_sizes`); everything else fails here too.
"""

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized

from core import interpret, testing
from pipelines import (
  Epilogue,
  MatmulDimension,
  Schedule,
  TuningConfig,
  matmul,
  matmul_reference,
  pingpong_matmul_sm90,
  ws_matmul,
)
from pipelines import matmul_test_base as base
from pipelines.operands import OperandLayout

SMALL_PINGPONG = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                              epi_tile_m=64, epi_tile_n=32, grid_tile_width=2,
                              schedule=Schedule.PINGPONG)


class PingPongMatmulTest(base.MatmulTestBase):

  def run_matmul(self, lhs, rhs, bias=None, *, epilogue=Epilogue(), out_dtype=None,
                 config_fields=None, layout=base.NN):
    config = dataclasses.replace(SMALL_PINGPONG, **(config_fields or {}))
    return ws_matmul(lhs, rhs, bias, config=config, epilogue=epilogue, out_dtype=out_dtype,
                     layout=layout)

  @parameterized.parameters(
      # 12 tiles on 2 blocks: 3 per warpgroup; ragged N; 3 K steps through 2
      # slots, so tiles start mid-ring.
      (2, (192, 192, 200), jnp.float16, 2, Epilogue()),
      # 5 tiles on 3 blocks: one block's second warpgroup gets no tile; one K step.
      (3, (320, 64, 64), jnp.bfloat16, 2, Epilogue(activation="gelu", has_bias=True)),
      (1, (192, 128, 128), jnp.float16, 2, Epilogue(activation="silu", has_bias=True)),
      # One slot: each slot is released before the next load.
      (2, (192, 128, 64), jnp.float16, 1, Epilogue()),
      # 2 K steps through 3 slots: a tile's loads start in the other's K loop.
      (2, (256, 128, 192), jnp.bfloat16, 3, Epilogue(activation="relu", has_bias=True)),
  )
  def test_ring_of_slots_across_tiles(self, num_blocks, shape, dtype, steps, epilogue):
    self.check(shape, dtype, seed=14, epilogue=epilogue, num_blocks=num_blocks,
               config_fields=dict(max_concurrent_steps=steps))

  @parameterized.parameters(*MatmulDimension)
  def test_tile_order(self, grid_minor_dim):
    """Tiles advance along either output dimension (the heuristic orders a
    weight gradient's tiles at short K along N): 3x5 tiles of a (K, M) LHS on
    2 blocks, in bands of 2 that leave a part band, with a ragged last column."""
    self.check((192, 128, 296), jnp.bfloat16, seed=41, num_blocks=2,
               layout=OperandLayout(transpose_lhs=True),
               config_fields=dict(grid_minor_dim=grid_minor_dim))

  def test_memory_warpgroup_that_ignores_releases_is_caught(self):
    """Caught by the race detector or by the interpreter's barrier-phase check
    (a phase completed that no thread waited for), whichever fires first."""
    if self.backend != testing.INTERPRET:
      self.skipTest("a planted race, for the interpreter's race detector")
    barriers = 2 * SMALL_PINGPONG.max_concurrent_steps
    wait = pingpong_matmul_sm90.plgpu.barrier_wait

    def skip_release_waits(ref):
      aval = ref.ref.aval if hasattr(ref, "ref") else ref.aval
      # The "consumed" barriers: one arrival, one per slot and warpgroup.
      if aval.inner_aval.shape == (barriers,) and aval.inner_aval.dtype.num_arrivals == 1:
        return
      wait(ref)

    lhs, rhs = base.operands(16, 192, 256, 128, jnp.float16)
    with base.with_blocks(2), mock.patch.object(pingpong_matmul_sm90.plgpu, "barrier_wait",
                                           skip_release_waits):
      try:
        jax.block_until_ready(ws_matmul(lhs, rhs, config=SMALL_PINGPONG))
        caught = interpret.races_found()
      except Exception as e:  # noqa: BLE001 - the interpreter's barrier check may fire first.
        interpret.reset_after_failure()
        caught = "no threads observed phase" in str(e)
    self.assertTrue(caught, "a slot refilled before its release was not reported")

  @parameterized.parameters(((4096, 4096, 4096), "none"), ((2000, 1024, 3000), "gelu"))
  def test_real_sizes(self, shape, activation):
    if self.backend != testing.GPU:
      self.skipTest("real sizes run on the GPU only (minutes in the interpreter)")
    config = TuningConfig(tile_m=128, tile_n=128, max_concurrent_steps=6,
                          schedule=Schedule.PINGPONG)
    m, k, n = shape
    lhs, rhs = base.operands(17, m, k, n, jnp.bfloat16)
    bias = testing.random_array(18, (n,), jnp.bfloat16)
    out = self.run_kernel(matmul, lhs, rhs, bias, activation=activation, config=config)
    ref = matmul_reference(lhs, rhs, bias, epilogue=Epilogue(activation=activation,
                                                             has_bias=True))
    self.assert_close(out, ref, dtype=jnp.bfloat16)


if __name__ == "__main__":
  absltest.main()
