"""Unit tests of core: device facts, layouts, compiler options, SMEM budgets, the switch."""

import os
from unittest import mock

import jax.numpy as jnp
from absl.testing import absltest, parameterized
from jax.experimental.pallas import mosaic_gpu as plgpu

import core
from core import compiler, device, interpret, memory, quickstart, smem_budget, testing
from core.numerics import relative_error


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
      fill = lambda s=shape, d=dtype: quickstart.fill(s, 1.0, d)  # noqa: E731
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

  def test_automatic_without_gpu(self):
    if device.has_gpu():
      self.skipTest("checks the no-GPU default")
    with mock.patch.dict(os.environ, {interpret.INTERPRET_ENV: ""}):
      self.assertTrue(interpret.is_interpreting())


class NumericsTest(absltest.TestCase):

  def test_relative_error(self):
    ref = jnp.arange(1.0, 5.0)
    self.assertAlmostEqual(relative_error(ref * 1.01, ref), 0.01, places=6)
    self.assertEqual(relative_error(ref.at[0].set(jnp.nan), ref), float("inf"))
    with self.assertRaisesRegex(ValueError, "shape mismatch"):
      relative_error(ref[:2], ref)


if __name__ == "__main__":
  absltest.main()
