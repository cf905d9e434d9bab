"""The sweep's logic and the tuning cache, with a stand-in timer (no GPU needed)."""

import os
import tempfile
from unittest import mock

import jax.numpy as jnp
from absl.testing import absltest

from core import interpret_mode, testing
from pipelines import autotune, matmul, tuning_cache
from pipelines.config import MatmulDimension, Schedule, TuningConfig
from pipelines.operands import MatmulProblem

TINY_SPACE = autotune.SearchSpace(tile_m=(64,), tile_n=(64, 512), max_concurrent_steps=(2, 9),
                                  epi_tile=((64, 64),), grid_minor_dim=(MatmulDimension.M,),
                                  grid_tile_width=(1,), wg_dimension=(MatmulDimension.N,),
                                  schedule=(Schedule.COOPERATIVE,))


class AutotuneTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    cache = os.path.join(tempfile.mkdtemp(), "cache.json")
    self.enter_context(mock.patch.dict(os.environ, {tuning_cache.CACHE_ENV: cache}))

  def test_budget_rejects_without_compiling_and_the_fastest_wins(self):
    problem = MatmulProblem(m=128, k=128, n=128, dtype=jnp.dtype(jnp.float16))
    feasible = autotune.feasible_configs(problem, jnp.float16, TINY_SPACE)
    # tile_n=512 is not a valid config; 9 steps clamp to 2 K steps (same SMEM).
    self.assertEqual({(c.tile_n, c.max_concurrent_steps) for c in feasible}, {(64, 2), (64, 9)})
    lhs = testing.random_array(0, (128, 128), jnp.float16)
    rhs = testing.random_array(1, (128, 128), jnp.float16)
    fake_times = iter([5.0, 3.0])
    with interpret_mode(detect_races=False):
      results = autotune.tune(lhs, rhs, space=TINY_SPACE, timer=lambda fn, args: next(fake_times),
                              store=True, log=open(os.devnull, "w"))
    self.assertEqual([r.median_us for r in results], [3.0, 5.0])
    self.assertEqual(tuning_cache.lookup(problem, jnp.float16), results[0].config)

  def test_explicit_configs_are_checked_too(self):
    problem = MatmulProblem(m=1024, k=4096, n=1024, dtype=jnp.dtype(jnp.float16))
    fits = TuningConfig(tile_m=128, tile_n=192, schedule=Schedule.PINGPONG)
    too_deep = TuningConfig(tile_m=64, tile_n=256, max_concurrent_steps=6,
                            wg_dimension=MatmulDimension.M)
    self.assertEqual(autotune.feasible_configs(problem, jnp.float16, [fits, too_deep]), [fits])

  def test_cache_miss_modes(self):
    lhs = jnp.zeros((64, 64), jnp.float16)
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

  def test_json_round_trip(self):
    for config in (TuningConfig(tile_m=64, tile_n=256, wg_dimension=MatmulDimension.M),
                   TuningConfig(tile_n=192, schedule=Schedule.PINGPONG)):
      self.assertEqual(tuning_cache.config_from_json(tuning_cache.config_to_json(config)),
                       config)
    # Entries written before schedules existed are cooperative.
    legacy = tuning_cache.config_to_json(TuningConfig())
    del legacy["schedule"]
    self.assertEqual(tuning_cache.config_from_json(legacy).schedule, Schedule.COOPERATIVE)

  def test_shipped_cache_entries_are_valid_configs(self):
    with mock.patch.dict(os.environ, {tuning_cache.CACHE_ENV: str(tuning_cache.DEFAULT_CACHE)}):
      entries = tuning_cache._load(tuning_cache.cache_path())
    self.assertNotEmpty(entries)
    for entry in entries.values():
      tuning_cache.config_from_json(entry["config"])


if __name__ == "__main__":
  absltest.main()
