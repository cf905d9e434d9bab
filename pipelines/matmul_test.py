"""The matmul kernels against a float32 reference, in interpret mode and on a GPU."""

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import device, interpret, testing
from pipelines import (
  Epilogue,
  MatmulDimension,
  PipelinedConfig,
  Schedule,
  TuningConfig,
  matmul,
  matmul_reference,
  pallas_call_matmul,
  pingpong_matmul_sm90,
  pipelined_matmul,
  ws_matmul,
  ws_matmul_sm90,
)

DTYPES = (jnp.float16, jnp.bfloat16)
# Small configs keep the interpreter fast; the GPU runs the same code paths at
# real sizes below.
SMALL_PIPELINED = PipelinedConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)
SMALL_WS = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                        epi_tile_m=64, epi_tile_n=32, grid_tile_width=2)
SMALL_PINGPONG = dataclasses.replace(SMALL_WS, schedule=Schedule.PINGPONG)
# Epilogue tilings whose store count per tile is odd (3 sub-tiles through 2
# staging slots), so consecutive tiles of a block start on different slots.
ODD_EPILOGUE_TILINGS = (
    dict(tile_m=64, tile_n=192, epi_tile_m=64, epi_tile_n=64),
    dict(tile_m=192, tile_n=64, epi_tile_m=64, epi_tile_n=64),
)


def no_kernel_built():
  return mock.patch.object(plgpu, "kernel", side_effect=AssertionError("a kernel was built"))


def operands(seed, m, k, n, dtype):
  return (testing.random_array(seed, (m, k), dtype), testing.random_array(seed + 1, (k, n), dtype))


class PipelinedMatmulTest(testing.KernelTestCase):

  @parameterized.product(dtype=DTYPES, shape=[(128, 256, 128), (192, 128, 136)])
  def test_matches_reference(self, dtype, shape):
    m, k, n = shape
    lhs, rhs = operands(0, m, k, n, dtype)
    out = self.run_kernel(pipelined_matmul, lhs, rhs, config=SMALL_PIPELINED)
    self.assertEqual(out.dtype, dtype)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=dtype)

  @parameterized.product(delay_release=[0, 1], steps=[2, 3], out_dtype=[None, jnp.float32])
  def test_pipeline_knobs(self, delay_release, steps, out_dtype):
    if delay_release >= steps:
      self.skipTest("invalid combination, covered by the validation test")
    config = dataclasses.replace(SMALL_PIPELINED, delay_release=delay_release,
                                 max_concurrent_steps=steps)
    lhs, rhs = operands(1, 64, 256, 64, jnp.float16)
    out = self.run_kernel(pipelined_matmul, lhs, rhs, config=config, out_dtype=out_dtype)
    self.assertEqual(out.dtype, out_dtype or jnp.float16)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)

  @parameterized.parameters((0, 64, 64), (64, 0, 64), (64, 64, 0))
  def test_empty_problems_launch_no_kernel(self, m, k, n):
    lhs, rhs = operands(32, m, k, n, jnp.float16)
    with no_kernel_built():
      out = pipelined_matmul(lhs, rhs, config=SMALL_PIPELINED, out_dtype=jnp.float32)
    self.assertEqual((out.shape, out.dtype), ((m, n), jnp.float32))
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float32)

  def test_narrow_swizzle(self):
    """32-wide K and N tiles: both operands get the same 64-byte swizzle."""
    config = PipelinedConfig(tile_m=64, tile_n=32, tile_k=32, max_concurrent_steps=3)
    lhs, rhs = operands(3, 64, 128, 96, jnp.bfloat16)
    out = self.run_kernel(pipelined_matmul, lhs, rhs, config=config)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.bfloat16)

  def test_real_size(self):
    if self.backend != testing.GPU:
      self.skipTest("real sizes run on the GPU only (minutes in the interpreter)")
    lhs, rhs = operands(2, 4096, 4096, 4096, jnp.float16)
    for config in (PipelinedConfig(), PipelinedConfig(tile_n=192, max_concurrent_steps=3)):
      out = self.run_kernel(pipelined_matmul, lhs, rhs, config=config)
      self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)


class WarpSpecializedMatmulTest(testing.KernelTestCase):

  @parameterized.product(dtype=DTYPES, wg_dimension=list(MatmulDimension),
                         grid_minor_dim=list(MatmulDimension))
  def test_matches_reference(self, dtype, wg_dimension, grid_minor_dim):
    config = dataclasses.replace(SMALL_WS, wg_dimension=wg_dimension,
                                 grid_minor_dim=grid_minor_dim)
    lhs, rhs = operands(3, 256, 128, 256, dtype)
    out = self.run_kernel(ws_matmul, lhs, rhs, config=config)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=dtype)

  @parameterized.product(activation=["none", "relu", "gelu", "silu"], has_bias=[False, True])
  def test_fused_epilogue(self, activation, has_bias):
    lhs, rhs = operands(4, 128, 128, 192, jnp.bfloat16)
    bias = testing.random_array(6, (192,), jnp.bfloat16) if has_bias else None
    epilogue = Epilogue(activation=activation, has_bias=has_bias)
    out = self.run_kernel(ws_matmul, lhs, rhs, bias, config=SMALL_WS, epilogue=epilogue,
                          out_dtype=jnp.float32)
    self.assertEqual(out.dtype, jnp.float32)
    self.assert_close(out, matmul_reference(lhs, rhs, bias, epilogue=epilogue),
                      dtype=jnp.bfloat16)

  @parameterized.parameters(
      # 8 CTA tiles on 3 blocks (3, 3, 2 each): each block's pipelines reuse
      # the same slots and barriers tile after tile.
      (3, (256, 128, 256), 2, Epilogue(activation="gelu", has_bias=True)),
      (2, (256, 192, 128), 2, Epilogue()),  # 3 K steps through 2 slots.
  )
  def test_several_tiles_per_block(self, num_blocks, shape, steps, epilogue):
    config = dataclasses.replace(SMALL_WS, max_concurrent_steps=steps)
    self.check_on_blocks(num_blocks, shape, config, epilogue, seed=19)

  def check_on_blocks(self, num_blocks, shape, config, epilogue, *, seed, out_dtype=None):
    """Runs `ws_matmul` (bfloat16 operands) on a grid capped at `num_blocks`
    and checks it against the reference; returns the output."""
    m, k, n = shape
    lhs, rhs = operands(seed, m, k, n, jnp.bfloat16)
    bias = testing.random_array(seed + 2, (n,), jnp.bfloat16) if epilogue.has_bias else None
    with with_blocks(num_blocks):
      # The poison must cover float32 partials of a split K too.
      out = self.run_kernel(ws_matmul, lhs, rhs, bias, config=config, epilogue=epilogue,
                            out_dtype=out_dtype)
    self.assert_close(out, matmul_reference(lhs, rhs, bias, epilogue=epilogue),
                      dtype=jnp.bfloat16)
    return out

  @parameterized.parameters(
      (200, 128, 136), (64, 64, 40), (130, 192, 248),
      # Narrower than one 64x128 CTA tile, with several K steps.
      (128, 128, 64), (40, 192, 256), (8, 128, 64))
  def test_ragged_m_and_n_are_masked(self, m, k, n):
    lhs, rhs = operands(7, m, k, n, jnp.float16)
    out = self.run_kernel(matmul, lhs, rhs, config=SMALL_WS)
    self.assertEqual(out.shape, (m, n))
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)

  @parameterized.parameters(
      # (blocks, M x K x N, k_splits, epilogue, out dtype): 2 splits of 2 K
      # steps; 4 splits of one step each, 8 work items on 3 blocks; ragged
      # M and N with the bias and activation applied after the sum.
      (4, (128, 256, 128), 2, Epilogue(), jnp.bfloat16),
      (3, (128, 256, 256), 4, Epilogue(activation="silu", has_bias=True), jnp.float32),
      (4, (136, 128, 200), 2, Epilogue(activation="relu", has_bias=True), jnp.bfloat16),
  )
  def test_split_k(self, num_blocks, shape, k_splits, epilogue, out_dtype):
    config = dataclasses.replace(SMALL_WS, k_splits=k_splits)
    out = self.check_on_blocks(num_blocks, shape, config, epilogue, seed=21,
                               out_dtype=out_dtype)
    self.assertEqual((out.shape, out.dtype), (shape[::2], out_dtype))

  @parameterized.product(tiling=ODD_EPILOGUE_TILINGS, wg_dimension=list(MatmulDimension))
  def test_odd_epilogue_tilings(self, tiling, wg_dimension):
    """Several tiles per block, each making 3 stores through 2 staging slots:
    a tile's first store must wait for the last store of the one before."""
    config = dataclasses.replace(SMALL_WS, wg_dimension=wg_dimension, **tiling)
    shape = (4 * config.cta_tile_m, 64, 2 * config.cta_tile_n)
    self.check_on_blocks(2, shape, config, Epilogue(activation="relu", has_bias=True), seed=23)

  @parameterized.parameters(1, 2)
  def test_bias_is_added_in_float32(self, k_splits):
    """A float32 bias that cancels most of a large accumulator: cast to a
    float16 output first (70000 -> inf), it would make every element inf."""
    m, k, n = 64, 128, 64
    lhs = jnp.ones((m, k), jnp.float16)
    noise = testing.random_array(25, (k, n), jnp.float32, scale=0.5)
    rhs = (noise - 544.0).astype(jnp.float16)  # Each accumulator about -69632.
    bias = jnp.full((n,), 70000.0, jnp.float32) + testing.random_array(26, (n,), jnp.float32)
    config = dataclasses.replace(SMALL_WS, k_splits=k_splits)
    epilogue = Epilogue(activation="relu", has_bias=True)
    out = self.run_kernel(ws_matmul, lhs, rhs, bias, config=config, epilogue=epilogue)
    ref = matmul_reference(lhs, rhs, bias, epilogue=epilogue)
    self.assertTrue(bool(jnp.all(jnp.abs(ref) < 1000)), "the reference must fit in float16")
    self.assert_close(out, ref, dtype=jnp.float16)

  @parameterized.parameters((0, 64, 64), (64, 64, 0), (0, 0, 0), (64, 0, 128))
  def test_empty_problems_launch_no_kernel(self, m, k, n):
    """As `jnp.dot`: an empty output, or for K = 0 the epilogue of zeros."""
    lhs, rhs = operands(27, m, k, n, jnp.bfloat16)
    bias = testing.random_array(28, (n,), jnp.float32)
    epilogue = Epilogue(activation="silu", has_bias=True)
    with no_kernel_built():
      out = matmul(lhs, rhs, bias, activation="silu", out_dtype=jnp.float32)
      explicit = ws_matmul(lhs, rhs, bias, config=SMALL_WS, epilogue=epilogue)
    ref = matmul_reference(lhs, rhs, bias, epilogue=epilogue)
    self.assertEqual((out.shape, out.dtype), ((m, n), jnp.float32))
    self.assertEqual((explicit.shape, explicit.dtype), ((m, n), jnp.bfloat16))
    self.assert_close(out, ref, dtype=jnp.float32)
    self.assert_close(explicit, ref, dtype=jnp.bfloat16)

  @parameterized.parameters(16, 48, 80, 144)
  def test_k_multiple_of_16_with_the_default_config(self, k):
    """K off the heuristic's 64-wide K tile is zero-padded to it."""
    lhs, rhs = operands(29, 72, k, 64, jnp.float16)
    bias = testing.random_array(30, (64,), jnp.float16)
    out = self.run_kernel(matmul, lhs, rhs, bias, activation="gelu")
    ref = matmul_reference(lhs, rhs, bias, epilogue=Epilogue(activation="gelu", has_bias=True))
    self.assert_close(out, ref, dtype=jnp.float16)

  def test_k_off_the_split_multiple(self):
    """K = 3 tile_k steps in 2 splits: padded to 4 steps."""
    config = dataclasses.replace(SMALL_WS, k_splits=2)
    self.check_on_blocks(4, (64, 192, 64), config, Epilogue(), seed=31)

  def test_real_sizes_and_epilogues(self):
    if self.backend != testing.GPU:
      self.skipTest("real sizes run on the GPU only (minutes in the interpreter)")
    # The last two take the heuristic's split K (8 and 4 ranges).
    for (m, k, n), activation in (((4096, 4096, 4096), "none"), ((2000, 1024, 3000), "gelu"),
                                  ((8192, 1024, 2048), "silu"), ((1024, 2048, 1024), "relu"),
                                  ((512, 16384, 1024), "gelu"), ((250, 8192, 4000), "silu")):
      lhs, rhs = operands(8, m, k, n, jnp.bfloat16)
      bias = testing.random_array(9, (n,), jnp.bfloat16)
      out = self.run_kernel(matmul, lhs, rhs, bias, activation=activation)
      ref = matmul_reference(lhs, rhs, bias, epilogue=Epilogue(activation=activation,
                                                               has_bias=True))
      self.assert_close(out, ref, dtype=jnp.bfloat16)


def with_blocks(num_blocks: int):
  """Caps the persistent grid at `num_blocks`, so each block loops over several tiles."""
  facts = dataclasses.replace(device.device_facts(), sm_count=num_blocks)
  return mock.patch.object(ws_matmul_sm90, "device_facts", return_value=facts)


class PingPongMatmulTest(testing.KernelTestCase):
  """The ping-pong schedule. The interpreter runs wgmma synchronously and
  ignores `wgmma_wait`, so releasing a slot while a wgmma still reads it can
  only fail on a GPU (`test_real_sizes`); everything else fails here too."""

  @parameterized.parameters(
      # 12 tiles on 2 blocks: 3 per warpgroup; ragged N; 3 K steps through 2
      # slots, so tiles start mid-ring.
      (2, (192, 192, 200), jnp.float16, 2, Epilogue()),
      # 5 tiles on 3 blocks: one block's second warpgroup gets no tile; one K step.
      (3, (320, 64, 64), jnp.bfloat16, 2, Epilogue(activation="gelu", has_bias=True)),
      (1, (192, 128, 128), jnp.float16, 2, Epilogue(activation="silu", has_bias=True)),
      # One slot: each slot is released before the next load.
      (2, (192, 128, 64), jnp.float16, 1, Epilogue()),
      # Odd epilogue tilings: 3 stores per tile through 2 staging slots, and
      # 2 tiles per warpgroup.
      (1, (256, 64, 192), jnp.float16, 2, Epilogue(activation="relu", has_bias=True),
       ODD_EPILOGUE_TILINGS[0]),
      (1, (768, 64, 64), jnp.bfloat16, 2, Epilogue(), ODD_EPILOGUE_TILINGS[1]),
      # 2 K steps through 3 slots: a tile's loads start in the other's K loop.
      (2, (256, 128, 192), jnp.bfloat16, 3, Epilogue(activation="relu", has_bias=True)),
  )
  def test_matches_reference(self, num_blocks, shape, dtype, steps, epilogue, tiling=None):
    m, k, n = shape
    lhs, rhs = operands(14, m, k, n, dtype)
    bias = testing.random_array(15, (n,), dtype) if epilogue.has_bias else None
    config = dataclasses.replace(SMALL_PINGPONG, max_concurrent_steps=steps, **(tiling or {}))
    with with_blocks(num_blocks):
      out = self.run_kernel(ws_matmul, lhs, rhs, bias, config=config,
                            epilogue=epilogue)
    self.assertEqual(out.shape, (m, n))
    self.assert_close(out, matmul_reference(lhs, rhs, bias, epilogue=epilogue), dtype=dtype)

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

    lhs, rhs = operands(16, 192, 256, 128, jnp.float16)
    with with_blocks(2), mock.patch.object(pingpong_matmul_sm90.plgpu, "barrier_wait",
                                           skip_release_waits):
      try:
        jax.block_until_ready(ws_matmul(lhs, rhs, config=SMALL_PINGPONG))
        caught = interpret.races_found()
      except Exception as e:  # noqa: BLE001 - the interpreter's barrier check may fire first.
        interpret.reset_after_failure()
        caught = "no threads observed phase" in str(e)
    self.assertTrue(caught, "a slot refilled before its release was not reported")

  def test_real_sizes(self):
    if self.backend != testing.GPU:
      self.skipTest("real sizes run on the GPU only (minutes in the interpreter)")
    config = TuningConfig(tile_m=128, tile_n=128, max_concurrent_steps=6,
                          schedule=Schedule.PINGPONG)
    for (m, k, n), activation in (((4096, 4096, 4096), "none"), ((2000, 1024, 3000), "gelu")):
      lhs, rhs = operands(17, m, k, n, jnp.bfloat16)
      bias = testing.random_array(18, (n,), jnp.bfloat16)
      out = self.run_kernel(matmul, lhs, rhs, bias, activation=activation, config=config)
      ref = matmul_reference(lhs, rhs, bias, epilogue=Epilogue(activation=activation,
                                                               has_bias=True))
      self.assert_close(out, ref, dtype=jnp.bfloat16)


class MatmulApiTest(testing.KernelTestCase):

  def test_jit_and_vmap(self):
    lhs = testing.random_array(10, (3, 64, 128), jnp.float16)
    rhs = testing.random_array(11, (128, 64), jnp.float16)
    run = jax.jit(jax.vmap(functools.partial(matmul, config=SMALL_WS), in_axes=(0, None)))
    out = self.run_kernel(run, lhs, rhs)
    self.assert_close(out, jnp.einsum("bmk,kn->bmn", lhs.astype(jnp.float32),
                                      rhs.astype(jnp.float32)), dtype=jnp.float16)
    rhs_batch = testing.random_array(12, (3, 128, 64), jnp.float16)
    out = self.run_kernel(jax.vmap(functools.partial(matmul, config=SMALL_WS)), lhs, rhs_batch)
    self.assert_close(out, jnp.einsum("bmk,bkn->bmn", lhs.astype(jnp.float32),
                                      rhs_batch.astype(jnp.float32)), dtype=jnp.float16)

  def test_inside_shard_map(self):
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
    lhs, rhs = operands(13, 128, 128, 128, jnp.float16)
    spec = jax.sharding.PartitionSpec
    run = jax.shard_map(functools.partial(matmul, config=SMALL_WS), mesh=mesh,
                        in_specs=(spec("x", None), spec()), out_specs=spec("x", None))
    out = self.run_kernel(jax.jit(run), lhs, rhs)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)

  def test_heuristic_fills_the_sms(self):
    """128x256 CTA tiles while they make a full wave on 132 SMs, smaller ones below that."""
    from pipelines import default_config
    from pipelines import operands as ops
    for (m, k, n), cta in (((4096, 4096, 4096), (128, 256)), ((1024, 4096, 4096), (128, 256)),
                           ((512, 4096, 4096), (128, 128)), ((2048, 4096, 1024), (128, 128))):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.float16))
      config = default_config(problem, jnp.float16)
      self.assertEqual((config.cta_tile_m, config.cta_tile_n, config.k_splits), (*cta, 1),
                       f"{m}x{k}x{n}")
      self.assertEqual(config.schedule, Schedule.COOPERATIVE)

  def test_heuristic_splits_long_k_of_small_outputs(self):
    """Where even small tiles leave SMs idle and K is long, K is split so
    that (tile, K range) pairs make about one wave; each range >= 2048."""
    from pipelines import default_config
    from pipelines import operands as ops
    for (m, k, n), expected in (((512, 16384, 1024), (128, 256, 8)),
                                ((256, 8192, 4096), (128, 256, 4)),
                                ((1024, 8192, 1024), (128, 256, 4)),
                                ((512, 4096, 4096), (128, 128, 1)),  # 128 tiles already.
                                ((1024, 2048, 1024), (64, 128, 1)),  # K too short to split.
                                # Bound by HBM (the RHS): fewer partial bytes win.
                                ((128, 8192, 8192), (128, 128, 2)),
                                ((128, 16384, 4096), (128, 128, 4))):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.bfloat16))
      for out_dtype in (jnp.bfloat16, jnp.float32):
        config = default_config(problem, out_dtype)
        self.assertEqual((config.cta_tile_m, config.cta_tile_n, config.k_splits), expected,
                         f"{m}x{k}x{n}")
        ws_matmul_sm90.check_config(config, problem, out_dtype, has_bias=True)

  def test_heuristic_stages(self):
    """Small unsplit tiles get 6 stages (5 beside float32 staging tiles);
    split K and large tiles fewer."""
    from pipelines import default_config
    from pipelines import operands as ops
    f16, f32 = jnp.float16, jnp.float32
    for (m, k, n), out_dtype, expected in (((256, 8192, 8192), f16, (128, 128, 1, 6)),
                                           ((256, 8192, 8192), f32, (128, 128, 1, 5)),
                                           ((512, 4096, 2048), f16, (64, 128, 1, 6)),
                                           ((128, 8192, 8192), f16, (128, 128, 2, 4)),
                                           ((4096, 4096, 4096), f16, (128, 256, 1, 3))):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(f16))
      config = default_config(problem, out_dtype)
      self.assertEqual((config.cta_tile_m, config.cta_tile_n, config.k_splits,
                        config.max_concurrent_steps), expected, f"{m}x{k}x{n} -> {out_dtype}")
      ws_matmul_sm90.check_config(config, problem, out_dtype, has_bias=True)

  def test_heuristic_takes_pingpong_for_short_k(self):
    """Where K is short and 128x192 tiles leave the busiest SM at most 5% more work."""
    from pipelines import default_config
    from pipelines import operands as ops
    for (m, k, n), schedule in (((16384, 1024, 8192), Schedule.PINGPONG),
                                ((8192, 1024, 4096), Schedule.PINGPONG),  # 3% more work.
                                ((16384, 4096, 8192), Schedule.COOPERATIVE),  # Long K.
                                ((4096, 1024, 4096), Schedule.COOPERATIVE)):  # 12.5% more.
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.bfloat16))
      for out_dtype in (jnp.bfloat16, jnp.float32):
        config = default_config(problem, out_dtype)
        self.assertEqual(config.schedule, schedule, f"{m}x{k}x{n}")


class BadInputTest(parameterized.TestCase):
  """Errors come from our checks, before tracing or compiling anything."""

  def test_operand_errors(self):
    a = jnp.zeros((128, 64), jnp.float16)
    cases = [
        ((a, jnp.zeros((128, 64), jnp.float16)), "K of lhs and rhs differ"),
        ((a, jnp.zeros((64, 64), jnp.bfloat16)), "dtypes differ"),
        ((a.astype(jnp.float32), jnp.zeros((64, 64), jnp.float32)), "lhs.dtype=float32"),
        ((a[None], jnp.zeros((64, 64), jnp.float16)), "lhs must be 2-D"),
        ((jnp.zeros((128, 40), jnp.float16), jnp.zeros((40, 64), jnp.float16)),
         "multiple of 16"),
        ((a, jnp.zeros((64, 60), jnp.float16)), "N=60 must be a multiple of 8"),
    ]
    for fn in (matmul, pipelined_matmul):
      for args, message in cases:
        with self.assertRaisesRegex(ValueError, message):
          fn(*args)

  def test_config_errors(self):
    with self.assertRaisesRegex(ValueError, "tile_m=96"):
      TuningConfig(tile_m=96)
    with self.assertRaisesRegex(ValueError, "delay_release=2 must be smaller"):
      PipelinedConfig(max_concurrent_steps=2, delay_release=2)
    with self.assertRaisesRegex(ValueError, "max_concurrent_steps must be an int >= 1"):
      PipelinedConfig(max_concurrent_steps=0)
    with self.assertRaisesRegex(ValueError, "tile_n=512 exceeds"):
      PipelinedConfig(tile_n=512)
    with self.assertRaisesRegex(ValueError, "needs 256 registers per thread"):
      PipelinedConfig(tile_n=256)
    with self.assertRaisesRegex(ValueError, "activation='tanh'"):
      matmul(jnp.zeros((64, 64), jnp.float16), jnp.zeros((64, 64), jnp.float16),
             activation="tanh")
    lhs, rhs = jnp.zeros((512, 4096), jnp.float16), jnp.zeros((4096, 512), jnp.float16)
    with self.assertRaisesRegex(ValueError, "shared memory.*lhs_smem"):
      ws_matmul(lhs, rhs, config=TuningConfig(tile_m=64, tile_n=256, max_concurrent_steps=6,
                                              wg_dimension=MatmulDimension.M))
    with self.assertRaisesRegex(ValueError, "needs 256 registers per thread"):
      TuningConfig(tile_m=128, tile_n=256)
    with self.assertRaisesRegex(ValueError, "max_concurrent_steps=17 is too deep.*at most 16"):
      TuningConfig(max_concurrent_steps=17, schedule=Schedule.PINGPONG)
    with self.assertRaisesRegex(ValueError, "tile_n=96 must be a multiple of 64 when"):
      ws_matmul(lhs, rhs, config=TuningConfig(tile_n=96, epi_tile_n=32))
    with self.assertRaisesRegex(ValueError, "multiple of tile_k=128"):
      pipelined_matmul(jnp.zeros((64, 192), jnp.float16), jnp.zeros((192, 64), jnp.float16),
                       config=PipelinedConfig(tile_k=128))
    with self.assertRaisesRegex(ValueError, r"bias must have shape \(N,\)=\(512,\)"):
      matmul(lhs, rhs, jnp.zeros((7,), jnp.float16))
    with self.assertRaisesRegex(ValueError, "k_splits=0 must be an int >= 1"):
      TuningConfig(k_splits=0)
    with self.assertRaisesRegex(ValueError, "k_splits=2 needs schedule=Schedule.COOPERATIVE"):
      TuningConfig(k_splits=2, schedule=Schedule.PINGPONG)

  def test_operand_swizzles_must_match(self):
    """A K tile narrower than 128 bytes would give the LHS a narrower swizzle
    than the RHS, which Mosaic GPU rejects with an opaque layout error."""
    lhs, rhs = jnp.zeros((256, 512), jnp.bfloat16), jnp.zeros((512, 256), jnp.bfloat16)
    calls = [
        functools.partial(pipelined_matmul,
                          config=PipelinedConfig(tile_m=64, tile_n=128, tile_k=32)),
        functools.partial(pallas_call_matmul,
                          config=PipelinedConfig(tile_m=64, tile_n=128, tile_k=32)),
        functools.partial(ws_matmul, config=TuningConfig(tile_k=32)),
        functools.partial(ws_matmul, config=TuningConfig(tile_k=32, schedule=Schedule.PINGPONG)),
    ]
    for call in calls:
      with self.assertRaisesRegex(ValueError, "tile_k=32 gives bfloat16 LHS tiles a 64-byte "
                                  "swizzle.*use tile_k=64"):
        call(lhs, rhs)


if __name__ == "__main__":
  absltest.main()
