"""The sweep's logic, with a stand-in timer (no GPU needed)."""

import dataclasses
import os
import pathlib
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest

from core import interpret_mode, testing
from pipelines import autotune, default_config, kernel_call, matmul, tuning_cache
from pipelines.config import MatmulDimension, Schedule, TuningConfig
from pipelines.operands import NN, MatmulProblem, OperandLayout
from pipelines.reference import matmul_reference

TINY_SPACE = autotune.SearchSpace(tile_m=(64,), tile_n=(64, 512), max_concurrent_steps=(2, 9),
                                  epi_tile=((64, 64),), grid_minor_dim=(MatmulDimension.M,),
                                  grid_tile_width=(1,), wg_dimension=(MatmulDimension.N,),
                                  schedule=(Schedule.COOPERATIVE,))
# Three configs that fit a 128x128x128 float16 problem, told apart by their depth.
GOOD, WRONG, BROKEN = (TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=s,
                                    epi_tile_m=64, epi_tile_n=32) for s in (2, 3, 4))


def fake_ws_matmul(lhs, rhs, *, config, out_dtype, layout):
  """Stands in for the kernel: right for GOOD, wrong for WRONG, raises for BROKEN."""
  if config == BROKEN:
    raise RuntimeError("Mosaic GPU failed to compile the kernel")
  out = matmul_reference(lhs, rhs, layout=layout)
  return (out if config == GOOD else out + 1.0).astype(out_dtype)


class AutotuneTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.cache = os.path.join(tempfile.mkdtemp(), "cache.json")
    self.enter_context(mock.patch.dict(os.environ, {tuning_cache.CACHE_ENV: self.cache}))
    self.lhs = testing.random_array(0, (128, 128), jnp.float16)
    self.rhs = testing.random_array(1, (128, 128), jnp.float16)
    self.log = self.enter_context(open(os.devnull, "w"))

  def test_budget_rejects_without_compiling_and_the_fastest_wins(self):
    problem = MatmulProblem(m=128, k=128, n=128, dtype=jnp.dtype(jnp.float16))
    feasible = autotune.feasible_configs(problem, jnp.float16, TINY_SPACE)
    # tile_n=512 is not a valid config; 9 steps clamp to 2 K steps (same SMEM).
    self.assertEqual({(c.tile_n, c.max_concurrent_steps) for c in feasible}, {(64, 2), (64, 9)})
    # A space's sweep also times the heuristic's config, last.
    heuristic = default_config(problem, jnp.float16)
    self.assertNotIn(heuristic, feasible)
    feasible.append(heuristic)
    fake_times = iter([5.0, 3.0, 4.0])
    kernel = mock.Mock(wraps=kernel_call.ws_matmul)
    with interpret_mode(detect_races=False), mock.patch.object(kernel_call, "ws_matmul",
                                                               kernel):
      sweep = autotune.tune(self.lhs, self.rhs, space=TINY_SPACE,
                            timer=lambda fn, args: next(fake_times), store=True, log=self.log)
    # Only the feasible configs ran.
    self.assertCountEqual([c.kwargs["config"] for c in kernel.call_args_list], feasible)
    self.assertEqual([r.median_us for r in sweep.timed], [3.0, 4.0, 5.0])
    self.assertEmpty(sweep.rejected)
    self.assertEqual(sweep.stored_at, pathlib.Path(self.cache))
    self.assertEqual(tuning_cache.lookup(problem, jnp.float16), sweep.best.config)

  def test_a_space_never_tunes_slower_than_the_heuristic(self):
    """16x4096x4096's heuristic config (the transposed decode product, in K
    ranges) lies outside a grid of unsplit tiles; the sweep times it too,
    after the grid, and keeps it where it is the faster."""
    lhs = testing.random_array(2, (16, 4096), jnp.bfloat16)
    rhs = testing.random_array(3, (4096, 4096), jnp.bfloat16)
    problem = MatmulProblem(m=16, k=4096, n=4096, dtype=jnp.dtype(jnp.bfloat16))
    space = autotune.SearchSpace(tile_m=(64,), tile_n=(128,), max_concurrent_steps=(4,),
                                 epi_tile=((64, 64),), grid_minor_dim=(MatmulDimension.M,),
                                 grid_tile_width=(8,), wg_dimension=(MatmulDimension.N,),
                                 schedule=(Schedule.COOPERATIVE,))
    (grid_config,) = space.configs()
    self.enter_context(testing.facts_of_the_fitted_gpu())
    heuristic = default_config(problem, jnp.bfloat16)
    self.assertTrue(heuristic.swap_operands)

    def fake_kernel(lhs, rhs, *, config, out_dtype, layout):
      return matmul_reference(lhs, rhs, layout=layout).astype(out_dtype)

    times = iter([11.0, 8.0])
    with mock.patch.object(kernel_call, "ws_matmul", fake_kernel):
      sweep = autotune.tune(lhs, rhs, space=space, timer=lambda fn, args: next(times),
                            log=self.log)
    self.assertEqual([(c.config, c.median_us) for c in sweep.timed],
                     [(heuristic, 8.0), (grid_config, 11.0)])

  def test_rejected_configs_are_kept_apart_from_the_timed_ones(self):
    with mock.patch.object(kernel_call, "ws_matmul", fake_ws_matmul):
      sweep = autotune.tune(self.lhs, self.rhs, space=[WRONG, BROKEN, GOOD],
                            timer=lambda fn, args: 1.0, log=self.log)
    self.assertEqual([c.config for c in sweep.timed], [GOOD])
    self.assertEqual([c.config for c in sweep.rejected], [WRONG, BROKEN])
    self.assertStartsWith(sweep.rejected[0].reason, "wrong result: relative error")
    self.assertEqual(sweep.rejected[1].reason,
                     "RuntimeError: Mosaic GPU failed to compile the kernel")

  def test_a_non_finite_time_is_rejected_not_the_winner(self):
    times = iter([float("nan"), 2.0])
    with mock.patch.object(kernel_call, "ws_matmul", fake_ws_matmul):
      sweep = autotune.tune(self.lhs, self.rhs, space=[GOOD, dataclasses.replace(GOOD)],
                            timer=lambda fn, args: next(times), log=self.log)
    self.assertEqual([c.median_us for c in sweep.timed], [2.0])
    self.assertEqual(sweep.rejected[0].reason, "timing failed: the timer returned nan")

  def test_bad_spaces_and_out_dtypes_name_the_argument(self):
    problem = MatmulProblem(m=128, k=128, n=128, dtype=jnp.dtype(jnp.float16))
    with self.assertRaisesRegex(ValueError, r"SearchSpace.tile_m must be a non-empty tuple"):
      autotune.SearchSpace(tile_m=64)
    with self.assertRaisesRegex(ValueError, "space must be a SearchSpace or TuningConfigs, but "
                                "holds dict"):
      autotune.feasible_configs(problem, jnp.float16, [dict(tile_m=64)])
    with self.assertRaisesRegex(ValueError, "out_dtype=int8 must be"):
      autotune.feasible_configs(problem, jnp.int8, [GOOD])

  def test_no_passing_config_raises_with_reasons_by_kind(self):
    problem = MatmulProblem(m=128, k=128, n=128, dtype=jnp.dtype(jnp.float16))
    also_wrong = dataclasses.replace(WRONG, max_concurrent_steps=5)
    # RHS tile rows of 16 bytes cannot be swizzled: rejected without running.
    infeasible = TuningConfig(tile_m=64, tile_n=8, epi_tile_m=64, epi_tile_n=8)
    with (mock.patch.object(kernel_call, "ws_matmul", fake_ws_matmul),
          self.assertRaises(autotune.TuningError) as raised):
      autotune.tune(self.lhs, self.rhs, space=[WRONG, BROKEN, also_wrong, infeasible],
                    timer=lambda fn, args: 1.0, store=True, log=self.log)
    message = str(raised.exception)
    self.assertIn("none of the 4 configs tried", message)
    self.assertIn("128x128x128 float16->float16", message)
    self.assertIn("2x wrong result, e.g. ", message)
    self.assertIn("1x RuntimeError, e.g. ", message)
    self.assertIn("1x infeasible, e.g. ", message)
    self.assertLen(raised.exception.rejected, 3)
    # Nothing was stored for a sweep that found nothing.
    self.assertIsNone(tuning_cache.lookup(problem, jnp.float16))
    self.assertFalse(os.path.exists(self.cache))

  def test_refuses_traced_operands_before_running_anything(self):
    kernel = mock.Mock(side_effect=fake_ws_matmul)

    def under_jit(lhs, rhs):
      autotune.tune(lhs, rhs, space=[GOOD], timer=lambda fn, args: 1.0, log=self.log)
      return lhs

    with (mock.patch.object(kernel_call, "ws_matmul", kernel),
          self.assertRaisesRegex(ValueError, r"lhs is a traced value .*jax\.jit")):
      jax.jit(under_jit)(self.lhs, self.rhs)
    kernel.assert_not_called()

  def test_a_failed_store_keeps_the_sweep(self):
    # A cache path under a regular file cannot be written, even by root.
    blocker = os.path.join(tempfile.mkdtemp(), "a_file")
    pathlib.Path(blocker).write_text("")
    fallback_dir = tempfile.mkdtemp()
    problem = MatmulProblem(m=128, k=128, n=128, dtype=jnp.dtype(jnp.float16))
    with (mock.patch.dict(os.environ, {tuning_cache.CACHE_ENV: f"{blocker}/cache.json"}),
          mock.patch.object(tempfile, "tempdir", fallback_dir),
          mock.patch.object(kernel_call, "ws_matmul", fake_ws_matmul),
          self.assertLogs("pipelines.tuning_cache", "WARNING") as logs):
      sweep = autotune.tune(self.lhs, self.rhs, space=[GOOD], timer=lambda fn, args: 2.0,
                            store=True, log=self.log)
    self.assertEqual(sweep.best.config, GOOD)
    fallback = pathlib.Path(fallback_dir, "mgpu_cache.json")
    self.assertEqual(sweep.stored_at, fallback)
    self.assertIn(str(fallback), logs.output[0])
    with mock.patch.dict(os.environ, {tuning_cache.CACHE_ENV: str(fallback)}):
      self.assertEqual(tuning_cache.lookup(problem, jnp.float16), GOOD)

  def test_layouts_are_tuned_and_cached_apart(self):
    """A transposed layout is its own problem: its own sweep and cache key."""
    cache = os.path.join(tempfile.mkdtemp(), "cache.json")
    layout = OperandLayout(transpose_lhs=True)
    problem = MatmulProblem(m=128, k=128, n=128, dtype=jnp.dtype(jnp.float16), layout=layout)
    with (mock.patch.dict(os.environ, {tuning_cache.CACHE_ENV: cache}),
          mock.patch.object(kernel_call, "ws_matmul", fake_ws_matmul)):
      sweep = autotune.tune(self.lhs.T, self.rhs, layout=layout, space=[WRONG, GOOD],
                            timer=lambda fn, args: 2.0, store=True, log=self.log)
      self.assertEqual(sweep.best.config, GOOD)
      self.assertEqual(tuning_cache.lookup(problem, jnp.float16), GOOD)
      nn = dataclasses.replace(problem, layout=NN)
      self.assertIsNone(tuning_cache.lookup(nn, jnp.float16))
    self.assertTrue(tuning_cache.cache_key(problem, jnp.float16).endswith("|TN"))

  def test_a_store_that_fails_everywhere_still_returns_the_sweep(self):
    blocker = os.path.join(tempfile.mkdtemp(), "a_file")
    pathlib.Path(blocker).write_text("")
    with (mock.patch.dict(os.environ, {tuning_cache.CACHE_ENV: f"{blocker}/cache.json"}),
          mock.patch.object(tempfile, "tempdir", blocker),
          mock.patch.object(kernel_call, "ws_matmul", fake_ws_matmul),
          self.assertLogs("pipelines.autotune", "WARNING") as logs):
      sweep = autotune.tune(self.lhs, self.rhs, space=[GOOD], timer=lambda fn, args: 2.0,
                            store=True, log=self.log)
    self.assertEqual(sweep.best.config, GOOD)
    self.assertIsNone(sweep.stored_at)
    self.assertIn(f"the winner was {GOOD} at 2.0 us", logs.output[0])

  def test_k_that_tile_k_does_not_divide_is_tunable(self):
    # A last partial K step is read in place; a split K is zero-padded to
    # whole steps of each range.
    split = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                         epi_tile_m=64, epi_tile_n=32, k_splits=2)
    for k in (16, 32, 48, 80, 96, 144):
      with self.subTest(k=k):
        problem = MatmulProblem(m=128, k=k, n=128, dtype=jnp.dtype(jnp.float16))
        self.assertNotEmpty(autotune.feasible_configs(problem, jnp.float16,
                                                      autotune.SearchSpace()))
        self.assertEqual(autotune.feasible_configs(problem, jnp.float16, [GOOD, split]),
                         [GOOD, split])

  def test_explicit_configs_are_checked_too(self):
    problem = MatmulProblem(m=1024, k=4096, n=1024, dtype=jnp.dtype(jnp.float16))
    fits = TuningConfig(tile_m=128, tile_n=192, schedule=Schedule.PINGPONG)
    too_deep = TuningConfig(tile_m=64, tile_n=256, max_concurrent_steps=6,
                            wg_dimension=MatmulDimension.M)
    self.assertEqual(autotune.feasible_configs(problem, jnp.float16, [fits, too_deep]), [fits])

  def test_cache_miss_modes(self):
    lhs = testing.random_array(0, (64, 64), jnp.float16)
    with self.assertRaisesRegex(LookupError, "no tuned config.*64x64x64"):
      matmul(lhs, lhs, on_cache_miss="error")
    with self.assertRaisesRegex(ValueError, "on_cache_miss='guess'"):
      matmul(lhs, lhs, on_cache_miss="guess")

  def test_schedules_in_the_space(self):
    space = autotune.SearchSpace(tile_m=(64,), tile_n=(128,), max_concurrent_steps=(3,),
                                 epi_tile=((64, 64),), grid_minor_dim=(MatmulDimension.M,),
                                 grid_tile_width=(8,))
    configs = list(space.configs())
    # Both splits of the cooperative schedule; ping-pong has no split, so once.
    self.assertEqual(sorted((c.schedule.name, c.wg_dimension.name) for c in configs),
                     [("COOPERATIVE", "M"), ("COOPERATIVE", "N"), ("PINGPONG", "N")])

  def test_one_segment_rhs_tiles_and_clusters_in_the_space(self):
    """The cooperative schedule takes each rhs_tile_n and cluster_m of the
    space; ping-pong, which has neither, only the defaults."""
    space = autotune.SearchSpace(tile_m=(64,), tile_n=(128,), max_concurrent_steps=(3,),
                                 epi_tile=((64, 64),), grid_minor_dim=(MatmulDimension.M,),
                                 grid_tile_width=(8,), wg_dimension=(MatmulDimension.M,),
                                 rhs_tile_n=(None, 64), cluster_m=(1, 2))
    self.assertCountEqual([(c.schedule.name, c.rhs_tile_n, c.cluster_m) for c in space.configs()],
                          [("COOPERATIVE", None, 1), ("COOPERATIVE", None, 2),
                           ("COOPERATIVE", 64, 1), ("COOPERATIVE", 64, 2),
                           ("PINGPONG", None, 1)])

  def test_chained_tiles_in_the_space(self):
    """The cooperative schedule takes each chain_tiles value of the space;
    ping-pong, whose ring always runs across tiles, only the default."""
    space = autotune.SearchSpace(tile_m=(64,), tile_n=(128,), max_concurrent_steps=(4,),
                                 epi_tile=((64, 64),), grid_minor_dim=(MatmulDimension.M,),
                                 grid_tile_width=(8,), wg_dimension=(MatmulDimension.M,),
                                 chain_tiles=(False, True))
    self.assertCountEqual([(c.schedule.name, c.chain_tiles) for c in space.configs()],
                          [("COOPERATIVE", False), ("COOPERATIVE", True), ("PINGPONG", False)])


if __name__ == "__main__":
  absltest.main()
