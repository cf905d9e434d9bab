"""The matmul configs' SMEM model equals what Mosaic GPU allocates (lowered on CPU)."""

import functools

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized

from core import device, testing
from pipelines import (
    Epilogue,
    Fp8Config,
    MatmulDimension,
    PipelinedConfig,
    Schedule,
    TuningConfig,
    fp8_matmul,
    pallas_call_matmul,
    pipelined_matmul,
    ws_matmul,
    ws_smem_budget,
)
from pipelines.epilogue import TMA_SMEM_ALIGNMENT_BYTES, epilogue_scratch
from pipelines.operands import MatmulProblem, OperandLayout
from pipelines.pallas_call_matmul import DEFAULT_CONFIG as PALLAS_CALL_DEFAULT

S = jax.ShapeDtypeStruct


class SmemModelTest(parameterized.TestCase):

  @parameterized.parameters(
      (PipelinedConfig(), 4096),
      (PipelinedConfig(tile_n=192, max_concurrent_steps=3), 4096),
      (PipelinedConfig(tile_m=64, max_concurrent_steps=6), 128),  # Steps clamp to K steps.
  )
  def test_pipelined(self, config, k):
    fn = functools.partial(pipelined_matmul, config=config)
    args = S((1024, k), jnp.float16), S((k, 1024), jnp.float16)
    self.assertEqual(testing.mosaic_smem_bytes(fn, *args),
                     config.smem_budget(k, jnp.float16, jnp.float16).total_bytes)

  @parameterized.parameters(
      (TuningConfig(), False, jnp.bfloat16),
      (TuningConfig(wg_dimension=MatmulDimension.M, max_concurrent_steps=3), True, jnp.bfloat16),
      (TuningConfig(tile_m=64, tile_n=256, max_concurrent_steps=3,
                    wg_dimension=MatmulDimension.M), False, jnp.float32),
      (TuningConfig(max_concurrent_steps=3, schedule=Schedule.PINGPONG), True, jnp.bfloat16),
      (TuningConfig(tile_m=64, tile_n=256, max_concurrent_steps=2,
                    schedule=Schedule.PINGPONG), False, jnp.float32),
      # The heuristic's deepest pipeline: 6 stages of 128x128 tiles, with bias.
      (TuningConfig(tile_m=64, tile_n=128, wg_dimension=MatmulDimension.M,
                    max_concurrent_steps=6), True, jnp.bfloat16),
      # Split K: float32 staging tiles, no bias buffers (XLA adds the bias),
      # and the slots clamp to one split's 2 K steps.
      (TuningConfig(tile_m=64, tile_n=256, wg_dimension=MatmulDimension.M, k_splits=32),
       True, jnp.bfloat16),
      # An output quantized to e4m3 in the epilogue: its row maxima need no
      # reduction scratch (Mosaic GPU reserves 2048 bytes unless told).
      (TuningConfig(tile_m=64, tile_n=256, wg_dimension=MatmulDimension.M, epi_tile_n=128,
                    max_concurrent_steps=4), False, jnp.float8_e4m3fn),
      (TuningConfig(tile_m=64, tile_n=128, wg_dimension=MatmulDimension.M, epi_tile_n=128,
                    max_concurrent_steps=6), True, jnp.float8_e4m3fn),
      # 16-column tiles with a bias: each warpgroup's bias row padded to 128 bytes.
      (TuningConfig(tile_m=64, tile_n=16, epi_tile_n=16, wg_dimension=MatmulDimension.M,
                    max_concurrent_steps=3), True, jnp.bfloat16),
  )
  def test_warp_specialized(self, config, has_bias, out_dtype):
    epilogue = Epilogue(activation="gelu", has_bias=has_bias)
    fn = functools.partial(ws_matmul, config=config, epilogue=epilogue, out_dtype=out_dtype)
    args = [S((1024, 4096), jnp.bfloat16), S((4096, 2048), jnp.bfloat16)]
    args += [S((2048,), jnp.bfloat16)] if has_bias else []
    problem = MatmulProblem(m=1024, k=4096, n=2048, dtype=jnp.dtype(jnp.bfloat16))
    self.assertEqual(testing.mosaic_smem_bytes(fn, *args),
                     ws_smem_budget(config, problem, out_dtype, has_bias=has_bias).total_bytes)

  @parameterized.parameters(16, 48, 64, 256)
  def test_column_vector_rows_start_where_a_tma_copy_can(self, tile_n):
    """Each warpgroup's row of the bias (and column scales) is the destination
    of a TMA copy, which must start on 128 bytes: 16-column tiles' rows of 64
    bytes faulted with a misaligned address on an H100."""
    config = TuningConfig(tile_m=64, tile_n=tile_n, epi_tile_n=min(tile_n, 64),
                          wg_dimension=MatmulDimension.M)
    scratch = epilogue_scratch(config, jnp.bfloat16, has_bias=True, has_column_scales=True)
    for name in ("bias_smem", "column_scales_smem"):
      rows, width = scratch[name].shape
      self.assertEqual((width * 4) % TMA_SMEM_ALIGNMENT_BYTES, 0, name)
      self.assertGreaterEqual(width, tile_n, name)

  @parameterized.product(
      config=[TuningConfig(tile_m=64, tile_n=256, max_concurrent_steps=3,
                           wg_dimension=MatmulDimension.M),
              TuningConfig(tile_m=128, tile_n=192, max_concurrent_steps=4,
                           schedule=Schedule.PINGPONG)],
      transpose_lhs=[False, True], transpose_rhs=[False, True])
  def test_warp_specialized_layouts(self, config, transpose_lhs, transpose_rhs):
    """Tiles stored as the operands are: the same bytes, other shapes."""
    layout = OperandLayout(transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs)
    fn = functools.partial(ws_matmul, config=config, layout=layout)
    args = (S(layout.lhs_shape(1024, 4096), jnp.bfloat16),
            S(layout.rhs_shape(4096, 2048), jnp.bfloat16))
    problem = MatmulProblem(m=1024, k=4096, n=2048, dtype=jnp.dtype(jnp.bfloat16), layout=layout)
    self.assertEqual(testing.mosaic_smem_bytes(fn, *args),
                     ws_smem_budget(config, problem, jnp.bfloat16).total_bytes)

  @parameterized.parameters(
      (PALLAS_CALL_DEFAULT, 4096, jnp.float16),
      (PipelinedConfig(tile_m=64, tile_n=64, max_concurrent_steps=3), 2048, jnp.float32),
      (PipelinedConfig(tile_m=64, max_concurrent_steps=4), 128, jnp.bfloat16),  # 2 K steps.
  )
  def test_pallas_call(self, config, k, out_dtype):
    fn = functools.partial(pallas_call_matmul, config=config,
                           out_dtype=out_dtype)
    args = S((1024, k), jnp.float16), S((k, 1024), jnp.float16)
    self.assertEqual(testing.mosaic_smem_bytes(fn, *args),
                     config.pallas_call_smem_budget(k, jnp.float16, out_dtype).total_bytes)

  @parameterized.product(config=[Fp8Config(), Fp8Config(max_concurrent_steps=2),
                                 Fp8Config(compute_wgs=1),
                                 Fp8Config(compute_wgs=1, max_concurrent_steps=2),
                                 Fp8Config(persistent=False),
                                 Fp8Config(persistent=False, max_concurrent_steps=3),
                                 Fp8Config(k_blocks_per_step=2, max_concurrent_steps=2),
                                 Fp8Config(compute_wgs=3),
                                 Fp8Config(compute_wgs=3, max_concurrent_steps=2)],
                         has_bias=[False, True], k=[4096, 256, 384],
                         out_dtype=[jnp.bfloat16, jnp.float8_e4m3fn])
  def test_fp8(self, config, has_bias, k, out_dtype):
    args = [S((1024, k), jnp.float8_e4m3fn), S((1024, k), jnp.float8_e4m3fn),
            S((1024, k // 128), jnp.float32), S((8, k // 128), jnp.float32)]
    args += [S((1024,), jnp.float32)] if has_bias else []
    fn = functools.partial(fp8_matmul, out_dtype=out_dtype, config=config)
    self.assertEqual(testing.mosaic_smem_bytes(fn, *args),
                     config.smem_budget(k // 128, out_dtype, has_bias=has_bias).total_bytes)

  @parameterized.product(config=[Fp8Config(), Fp8Config(compute_wgs=1),
                                 Fp8Config(persistent=False),
                                 Fp8Config(k_blocks_per_step=2, max_concurrent_steps=2),
                                 Fp8Config(compute_wgs=3)],
                         has_bias=[False, True])
  def test_fp8_rhs_scaled_per_row(self, config, has_bias):
    k = 4096
    args = [S((1024, k), jnp.float8_e4m3fn), S((1024, k), jnp.float8_e4m3fn),
            S((1024, k // 128), jnp.float32), S((1024, k // 128), jnp.float32)]
    args += [S((1024,), jnp.float32)] if has_bias else []
    fn = functools.partial(fp8_matmul, config=config)
    self.assertEqual(testing.mosaic_smem_bytes(fn, *args),
                     config.smem_budget(k // 128, jnp.bfloat16, has_bias=has_bias,
                                        rhs_row_scales=True).total_bytes)

  def test_pallas_call_rejects_what_only_emit_pipeline_fits(self):
    # Depth 4 at 128x128 fits `pipelined_matmul` but not this path, which
    # also stages the output and keeps a float32 partial sum in SMEM.
    config = PipelinedConfig(max_concurrent_steps=4)
    fn = functools.partial(pallas_call_matmul, config=config)
    args = S((1024, 4096), jnp.float16), S((4096, 1024), jnp.float16)
    self.assertLessEqual(config.smem_budget(4096, jnp.float16, jnp.float16).total_bytes,
                         device.device_facts().smem_per_block_bytes)
    with self.assertRaisesRegex(ValueError, r"on the pallas_call path needs 327712 bytes.*"
                                            r"out_smem: 4 x \(128, 128\) float16"):
      jax.eval_shape(fn, *args)


if __name__ == "__main__":
  absltest.main()
