"""Unit tests of core: device facts, layouts, compiler options, SMEM budgets, the switch."""

import os
import time
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import core
from core import compiler, device, interpret, memory, smem_budget, testing, timing
from core.numerics import relative_error, relative_error_on_device


class DeviceFactsTest(absltest.TestCase):

  def test_interpret_mode_defaults_are_hopper(self):
    if device.has_gpu():
      self.skipTest("checks the CPU defaults")
    facts = core.device_facts()
    self.assertTrue(facts.simulated)
    self.assertTrue(facts.is_hopper)
    self.assertEqual(facts.sm_count, 132)
    self.assertEqual(facts.smem_per_block_bytes, 232448)


class MemoryTest(parameterized.TestCase):

  @parameterized.parameters((64, jnp.float16, 128), (32, jnp.bfloat16, 64), (16, jnp.float16, 32),
                            (128, jnp.float32, 128), (96, jnp.float16, 64))
  def test_widest_swizzle(self, minor, dtype, expected):
    self.assertEqual(memory.swizzle_bytes(minor, dtype), expected)

  @parameterized.parameters(
      # (tile, array) minor dimensions in float16; the (M, K) LHS first.
      (((64, 256), (4096, 4096)), 128),
      (((64, 256), (48, 2048)), 128),  # K = 48: one-segment LHS tiles go as boxes.
      (((64, 256), (4096, 4000)), 64),  # N = 4000 of the RHS.
      (((64, 256), (48, 2000)), 32),  # At 32 bytes the LHS tile is two segments.
      (((64,), (3000,)), 128),  # A 16-bit output under 64-column epilogue tiles.
      (((128,), (3000,)), None),  # The same output under 128-column ones.
      (((64,), (13,)), None))  # Rows off 16 bytes.
  def test_swizzle_for_tiles_and_arrays(self, dims, expected):
    tiles, arrays = dims
    if expected is None:
      with self.assertRaisesRegex(ValueError, "no swizzle fits"):
        memory.tma_swizzle(tiles, arrays, jnp.float16)
    else:
      self.assertEqual(memory.tma_swizzle(tiles, arrays, jnp.float16), expected)

  def test_transforms(self):
    tiling, swizzle = memory.tile_transforms(64, jnp.float16)
    self.assertEqual(tiling.tiling, (8, 64))
    self.assertEqual(swizzle.swizzle, 128)

  def test_errors_name_the_tile(self):
    with self.assertRaisesRegex(ValueError, "rhs tile: a row of 8 x float16 is 16 bytes"):
      memory.swizzle_bytes(8, jnp.float16, what="rhs tile")
    with self.assertRaisesRegex(ValueError, "does not exist on Hopper"):
      memory.require_space(core.TMEM, what="acc")
    with self.assertRaisesRegex(ValueError, r"\(64k, 8j\)"):
      memory.accumulator((32, 64))


  def test_tma_boxes_cover_a_run_in_boxes_of_at_most_256(self):
    self.assertEqual([(b.start, b.size) for b in memory.tma_boxes(100)], [(0, 100)])
    self.assertEqual([(b.start, b.size) for b in memory.tma_boxes(600)],
                     [(0, 256), (256, 256), (512, 88)])


class CompilerParamsTest(absltest.TestCase):

  def test_valid_params(self):
    params = compiler.compiler_params(dimension_semantics=("parallel", "sequential"),
                                      max_concurrent_steps=3, approx_math=True)
    self.assertIsInstance(params, plgpu.CompilerParams)
    self.assertEqual(params.dimension_semantics, ("parallel", "sequential"))
    self.assertEqual(params.max_concurrent_steps, 3)

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, "must be set together"):
      compiler.compiler_params(profile_dir="/tmp/x")
    with self.assertRaisesRegex(ValueError, r"\['diagonal'\] are not among"):
      compiler.compiler_params(dimension_semantics=("parallel", "diagonal"))
    with self.assertRaisesRegex(ValueError, "reduction_scratch_bytes must be >= 0"):
      compiler.compiler_params(reduction_scratch_bytes=-1)
    with self.assertRaisesRegex(ValueError, "delay_release=2 must be smaller"):
      compiler.PipelineOptions(max_concurrent_steps=2, delay_release=2)

  def test_profile_from_environment(self):
    with mock.patch.dict(os.environ, {compiler.PROFILE_DIR_ENV: "/tmp/traces"}):
      params = compiler.compiler_params()
    self.assertEqual((params.profile_dir, params.profile_space),
                     ("/tmp/traces", compiler.DEFAULT_PROFILE_SPACE))

  def test_pipeline_steps_are_clamped(self):
    self.assertEqual(compiler.PipelineOptions(max_concurrent_steps=4).steps_for(2), 2)


def _fill_through_smem(shape, dtype):
  """A one-block kernel whose only SMEM is one `shape` x `dtype` buffer, copied out by TMA."""

  def kernel(out_gmem, out_smem):
    out_smem[...] = jnp.full(shape, 1.0, dtype)
    plgpu.commit_smem()  # Make the register stores visible to the TMA engine.
    plgpu.copy_smem_to_gmem(out_smem, out_gmem)
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(shape, dtype),
                      scratch_types=[memory.smem(shape, dtype)],
                      compiler_params=compiler.compiler_params(),
                      interpret=interpret.interpret_params())()


class SmemBudgetTest(absltest.TestCase):

  def test_alignment_and_phases(self):
    a = smem_budget.SmemBuffer(name="a", shape=(10,), dtype=jnp.float32)
    b = smem_budget.SmemBuffer(name="b", shape=(64, 64), dtype=jnp.float16, copies=3)
    budget = smem_budget.SmemBudget(phases=((a, b), (b,)), num_barriers=3)
    self.assertEqual(budget.total_bytes, 1024 + 3 * 8192 + 24)
    with self.assertRaisesRegex(ValueError, r"cfg needs 25624 bytes.*b: 3 x \(64, 64\)"):
      budget.check(what="cfg", limit=20000)

  def test_model_matches_mosaic_for_fill(self):
    for shape, dtype in (((8, 128), jnp.float32), ((16, 64), jnp.bfloat16), ((100, 8), jnp.int32)):
      budget = smem_budget.SmemBudget(
          phases=((smem_budget.SmemBuffer(name="out", shape=shape, dtype=dtype),),))
      fill = lambda s=shape, d=dtype: _fill_through_smem(s, d)  # noqa: E731
      self.assertEqual(testing.mosaic_smem_bytes(fill), budget.total_bytes)


class InterpretSwitchTest(absltest.TestCase):

  def test_context_and_environment(self):
    with interpret.interpret_mode(detect_races=True):
      self.assertTrue(interpret.interpret_params().detect_races)
    with interpret.interpret_disabled():
      self.assertIsNone(interpret.interpret_params())
    with mock.patch.dict(os.environ, {interpret.INTERPRET_ENV: "1"}):
      self.assertTrue(interpret.is_interpreting())
    with mock.patch.dict(os.environ, {interpret.INTERPRET_ENV: "0"}):
      self.assertFalse(interpret.is_interpreting())
    with mock.patch.dict(os.environ, {interpret.INTERPRET_ENV: "maybe"}):
      with self.assertRaisesRegex(ValueError, "MGPU_INTERPRET='maybe'"):
        interpret.interpret_params()

  def test_warns_once_when_the_cpu_pool_could_deadlock(self):
    """Three waiting warpgroups can hold every thread of a pool smaller than
    `MIN_INTRA_OP_THREADS` (a 2-core machine): say how to size it, once."""
    small = interpret.MIN_INTRA_OP_THREADS - 2
    self.addCleanup(interpret._warn_if_intra_op_pool_is_small.cache_clear)  # noqa: SLF001
    interpret._warn_if_intra_op_pool_is_small.cache_clear()  # noqa: SLF001
    with (mock.patch.object(interpret, "intra_op_pool_size", return_value=small),
          self.assertLogs("core.interpret", "WARNING") as logs):
      for _ in range(2):
        with interpret.interpret_mode():
          pass
    self.assertLen(logs.records, 1)
    self.assertIn(f"has {small} threads", logs.records[0].getMessage())
    self.assertIn("PJRT_NPROC=16", logs.records[0].getMessage())
    interpret._warn_if_intra_op_pool_is_small.cache_clear()  # noqa: SLF001
    with (mock.patch.object(interpret, "intra_op_pool_size",
                            return_value=interpret.MIN_INTRA_OP_THREADS),
          self.assertNoLogs("core.interpret", "WARNING")):
      with interpret.interpret_mode():
        pass

  def test_automatic_without_gpu(self):
    if device.has_gpu():
      self.skipTest("checks the no-GPU default")
    with mock.patch.dict(os.environ, {interpret.INTERPRET_ENV: ""}):
      self.assertTrue(interpret.is_interpreting())


def _copy_then_read(*, wait_for_writes: bool):
  """Two TMA stores to `out`; then the kernel reads back the first one.

  Only the read side of both stores is waited for, unless `wait_for_writes`,
  so the plain read of `out[0]` races the first store's write.
  """
  cols = 128

  def kernel(out_gmem, seen_gmem, smem):
    smem[...] = jnp.full((2, cols), 1.0, jnp.float32)
    plgpu.commit_smem()
    for row in range(2):
      plgpu.copy_smem_to_gmem(smem.at[row], out_gmem.at[row])
      plgpu.wait_smem_to_gmem(0, wait_read_only=not wait_for_writes)
    seen_gmem[...] = out_gmem[0]
    plgpu.wait_smem_to_gmem(0)

  out_type = (jax.ShapeDtypeStruct((2, cols), jnp.float32),
              jax.ShapeDtypeStruct((cols,), jnp.float32))
  return plgpu.kernel(kernel, out_type=out_type,
                      scratch_types=[memory.smem((2, cols), jnp.float32)],
                      interpret=interpret.interpret_params())()


class RaceDetectorTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("read_races_unawaited_write", False, interpret.TMA_THREADS_PER_DEVICE, True),
      ("writes_waited_for", True, interpret.TMA_THREADS_PER_DEVICE, False),
      # Both stores share the one TMA pseudo-thread, so waiting for the second
      # one's read orders the first one's write: the race is missed. This is
      # why interpret mode gives every copy its own.
      ("one_tma_thread_misses_it", False, 1, False),
  )
  def test_unawaited_tma_write(self, wait_for_writes, tma_threads, racy):
    with interpret.interpret_mode(tma_threads_per_device=tma_threads):
      jax.block_until_ready(_copy_then_read(wait_for_writes=wait_for_writes))
    self.assertEqual(interpret.races_found(), racy)

  def test_race_log_sees_a_race_in_an_earlier_kernel(self):
    """`races_found()` answers for the last kernel only; the log keeps each."""
    with interpret.interpret_mode(), interpret.race_log() as states:
      jax.block_until_ready(_copy_then_read(wait_for_writes=False))
      jax.block_until_ready(_copy_then_read(wait_for_writes=True))
    self.assertFalse(interpret.races_found())
    self.assertEqual([state.races_found for state in states], [True, False])


def _copy_through_smem(x: jax.Array) -> jax.Array:
  """x (M, K) of a 16-bit dtype, copied by TMA through (16, 64) swizzled SMEM
  tiles (one segment of the 128-byte swizzle wide), one tile per block."""
  rows, cols = 16, 64

  def kernel(x_gmem, out_gmem, tile, loaded):
    window = (pl.ds(lax.axis_index("m") * rows, rows), pl.ds(lax.axis_index("k") * cols, cols))
    plgpu.copy_gmem_to_smem(x_gmem.at[window], tile, loaded)
    plgpu.barrier_wait(loaded)
    plgpu.copy_smem_to_gmem(tile, out_gmem.at[window])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                      grid=(pl.cdiv(x.shape[0], rows), pl.cdiv(x.shape[1], cols)),
                      grid_names=("m", "k"),
                      scratch_types=[memory.smem((rows, cols), x.dtype, swizzled=True),
                                     memory.barrier()],
                      compiler_params=compiler.compiler_params(),
                      interpret=interpret.interpret_params())(x)


class BoxedCopyTest(testing.KernelTestCase):
  """Tiles one swizzle segment wide reach arrays whose rows are off 8 and
  columns off 64 (`jax_private.copy_one_segment_tiles_as_boxes`), which
  Mosaic GPU's tiled TMA copies refuse; TMA masks the ragged edges."""

  @parameterized.parameters(((13, 40), jnp.float16), ((130, 200), jnp.bfloat16),
                            ((16, 64), jnp.float16))
  def test_ragged_arrays_round_trip(self, shape, dtype):
    x = testing.random_array(5, shape, dtype)
    out = self.run_kernel(jax.jit(_copy_through_smem), x)
    self.assertEqual(jnp.abs(out.astype(jnp.float32) - x.astype(jnp.float32)).max(), 0.0)

  def test_ragged_arrays_lower_for_the_gpu(self):
    """On CPU, lowered for an H200, where Mosaic GPU checks each TMA copy."""
    if self.backend == testing.GPU:
      self.skipTest("checks the lowering on CPU")
    x = jax.ShapeDtypeStruct((13, 40), jnp.float16)
    # A function of its own, so that jit's cache keeps this trace from the other tests.
    lowered = jax.jit(lambda x: _copy_through_smem(x))
    with interpret.interpret_disabled():
      text = lowered.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    self.assertEqual(text.count("stablehlo.custom_call @mosaic_gpu"), 1)


class KernelTestCaseTest(testing.KernelTestCase):
  """The test base itself must catch what it promises to."""

  def test_run_kernel_fails_on_a_race_before_the_last_kernel(self):
    if self.backend != testing.INTERPRET:
      self.skipTest("a planted race, for the interpreter's race detector")

    def racy_then_clean():
      return (_copy_then_read(wait_for_writes=False), _copy_then_read(wait_for_writes=True))

    with self.assertRaisesRegex(AssertionError, r"flagged kernel\(s\) \[0\] of 2"):
      self.run_kernel(racy_then_clean)

  def test_a_few_zeroed_elements_fail(self):
    """100 of 1024x1024 elements zeroed: a norm-wise error of 0.0099 passes the
    bfloat16 tolerance of 0.01, the element-wise bound does not."""
    ref = testing.random_array(0, (1024, 1024), jnp.float32)
    out = ref.astype(jnp.bfloat16)
    self.assert_close(out, ref, dtype=jnp.bfloat16)  # Rounding alone passes.
    zeroed = out.reshape(-1).at[::10486].set(0).reshape(ref.shape)
    self.assertLess(relative_error(zeroed, ref), 0.01)
    with self.assertRaisesRegex(AssertionError, "elements outside the bfloat16 element-wise"):
      self.assert_close(zeroed, ref, dtype=jnp.bfloat16)

  def test_output_bytes_counts_every_output(self):
    def two_outputs(x, rows, dtype):  # Non-array arguments stay concrete.
      return x.astype(dtype), jnp.zeros((rows, 5), jnp.float32)
    self.assertEqual(testing.output_bytes(two_outputs, jnp.ones((8, 4), jnp.float32), 3,
                                          jnp.float16), 8 * 4 * 2 + 3 * 5 * 4)


class NumericsTest(absltest.TestCase):

  def test_relative_error(self):
    ref = jnp.arange(1.0, 5.0)
    self.assertAlmostEqual(relative_error(ref * 1.01, ref), 0.01, places=6)
    self.assertEqual(relative_error(ref.at[0].set(jnp.nan), ref), float("inf"))
    with self.assertRaisesRegex(ValueError, "shape mismatch"):
      relative_error(ref[:2], ref)

  def test_relative_error_on_device_is_the_host_ones(self):
    """The benchmarks' error (float32, where the arrays live) against the
    float64 one on the host: the same to float32's precision, inf for any
    non-finite element of the output, of a 16-bit output too."""
    ref = jax.random.normal(jax.random.key(0), (1000, 300), jnp.float32)
    out = (ref + 1e-3 * jax.random.normal(jax.random.key(1), ref.shape)).astype(jnp.bfloat16)
    self.assertAlmostEqual(relative_error_on_device(out, ref) / relative_error(out, ref), 1.0,
                           places=5)
    for bad in (jnp.nan, jnp.inf):
      self.assertEqual(relative_error_on_device(out.at[7, 3].set(bad), ref), float("inf"))
    with self.assertRaisesRegex(ValueError, "shape mismatch"):
      relative_error_on_device(out[:2], ref)


class CompareRoundsTest(absltest.TestCase):

  def timings(self, *medians_us):
    return [timing.Timing(name="f", config="", compile_s=0.0, times_us=(t - 1, t, t + 5),
                          flops=2 * 10**9) for t in medians_us]

  def test_ratios_pair_rounds(self):
    # Both slow down in round 2, the kernel more in round 3: pairing rounds
    # gives 1.25, 1.0 and 0.8 (median 1.0), where the ratio of the overall
    # medians, 100 / 120, would call the kernel 17% slower.
    summary = timing.compare_rounds(self.timings(80, 120, 125), self.timings(100, 120, 100))
    self.assertEqual(summary["median_us"], 120)
    self.assertAlmostEqual(summary["tflops"], 2e9 / 120e-6 / 1e12)
    self.assertAlmostEqual(summary["ratio"], 1.0)
    self.assertAlmostEqual(summary["ratio_min"], 0.8)
    self.assertAlmostEqual(summary["ratio_max"], 1.25)
    self.assertEqual(summary["round_median_us"], [80, 120, 125])

  def test_round_counts_must_match(self):
    with self.assertRaisesRegex(ValueError, "same number"):
      timing.compare_rounds(self.timings(1, 2), self.timings(1))


class TimeWallTest(absltest.TestCase):

  def test_times_each_call_of_each_sample(self):
    calls = []

    def slow_host_step(x):
      calls.append(None)
      time.sleep(0.002)
      return x

    def fn(x):
      return jax.pure_callback(slow_host_step, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1

    t, out = timing.time_wall("f", fn, (jnp.zeros(4),), flops=8, iterations=3,
                              calls_per_sample=4)
    self.assertLen(calls, 1 + 3 * 4)  # The warm-up call, then the samples.
    self.assertLen(t.times_us, 3)
    self.assertGreaterEqual(min(t.times_us), 2000)  # Per call, not per sample.
    self.assertLess(max(t.times_us), 4 * 2000)
    self.assertEqual(out.tolist(), [1.0] * 4)

  def test_counts_must_be_positive(self):
    with self.assertRaisesRegex(ValueError, "calls_per_sample=0 must be >= 1"):
      timing.time_wall("f", jnp.sin, (jnp.zeros(4),), flops=1, calls_per_sample=0)


class TimeGpuTest(parameterized.TestCase):

  @parameterized.parameters(1, 3)
  def test_one_time_per_iteration(self, iterations):
    """One timed call as well as several: the profiler gives a lone call's
    time as a number, not a list."""
    if not device.has_gpu():
      self.skipTest("CUPTI times GPU kernels")
    t, out = timing.time_gpu("f", lambda x: x * 2, (jnp.ones(1 << 20),), flops=1 << 20,
                             iterations=iterations)
    self.assertLen(t.times_us, iterations)
    self.assertTrue(all(us > 0 for us in t.times_us))
    self.assertEqual(float(out[0]), 2.0)


if __name__ == "__main__":
  absltest.main()
