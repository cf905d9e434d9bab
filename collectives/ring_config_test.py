"""The ring's default config: one the ring kernel runs, or None where no tile divides the shards."""

import dataclasses

import jax.numpy as jnp
from absl.testing import absltest, parameterized

from collectives import ring_config, ring_matmul_sm90, ring_reduce_scatter_sm90
from core import testing
from pipelines import Schedule
from pipelines.operands import MatmulProblem


def shard_problem(m_shard, k, n_shard, dtype=jnp.float16):
  return MatmulProblem(m=m_shard, k=k, n=n_shard, dtype=jnp.dtype(dtype))


class DefaultRingConfigTest(parameterized.TestCase):
  """Configs chosen for the 132-SM GPUs their rules were fitted on, on any host."""

  def setUp(self):
    super().setUp()
    self.enter_context(testing.facts_of_the_fitted_gpu())


  @parameterized.parameters(
      # Where the plain matmul's heuristic splits K, takes ping-pong, or has a
      # tile that does not divide M_shard.
      ((256, 8192, 4096), jnp.float16),
      ((4096, 1024, 6144), jnp.bfloat16),
      ((320, 4096, 4096), jnp.float16),
      # The matmul heuristic's deepest pipelines, now with the ring's hold.
      ((256, 8192, 8192), jnp.float16),
      ((512, 4096, 2048), jnp.float16),
      ((128, 8192, 8192), jnp.bfloat16),
      ((4096, 4096, 4096), jnp.float16),
      # Shards only the narrower tiles divide.
      ((128, 512, 576), jnp.float16),
      ((256, 256, 64), jnp.bfloat16),
      ((192, 512, 1024), jnp.float16),
  )
  def test_is_one_the_ring_runs(self, shape, out_dtype):
    problem = shard_problem(*shape)
    config = ring_config.default_ring_config(problem, out_dtype)
    self.assertIsNotNone(config, f"{shape}")
    self.assertEqual(config.schedule, Schedule.COOPERATIVE)
    self.assertEqual(config.k_splits, 1)
    self.assertTrue(ring_config.divides(config, problem), f"{config} on {shape}")
    # Raises if the ring would refuse it (SMEM with delay_release=1 included).
    ring_matmul_sm90.check_ring_config(config, problem, out_dtype)

  @parameterized.parameters(
      # 576 = 3 x 192 = 9 x 64: 96 tiles of 128x192 or 288 of 128x64 (three
      # waves) leave the busiest SM the same work; the larger tile wins ties.
      ((4096, 512, 576), (128, 192)),
      # Less than a wave either way: 9 tiles of 128x64 keep 9 SMs busy where
      # 128x192 would keep 3.
      ((128, 512, 576), (128, 64)),
      ((256, 256, 64), (128, 64)),  # N_shard 64: only a 64-wide CTA tile divides.
      ((192, 512, 1024), (64, 128)),  # M_shard 3 x 64: 24 tiles rather than 12.
      # The measured default on two H200s (docs/performance-log.md, "The ring on two H200s
      # with the new defaults"): 128x128, 6 stages.
      ((512, 4096, 4096), (128, 128)),
      ((1024, 4096, 4096), (128, 256)),  # One full wave of the largest tile.
  )
  def test_tile_choice(self, shape, cta_tile):
    config = ring_config.default_ring_config(shard_problem(*shape), jnp.float16)
    self.assertEqual((config.cta_tile_m, config.cta_tile_n), cta_tile, f"{shape}: {config}")

  def test_deepest_pipeline_that_fits(self):
    config = ring_config.default_ring_config(shard_problem(512, 4096, 4096), jnp.float16)
    self.assertEqual(config.max_concurrent_steps, 6)

  @parameterized.parameters(
      (72, 512, 256),  # M_shard not a multiple of 64.
      (1000, 512, 256),
      (64, 512, 64),  # A 64x64 CTA tile would need a 64-row, 64-column split.
      (128, 512, 96),  # N_shard not a multiple of 64.
      (128, 200, 128),  # K not a multiple of tile_k = 64.
  )
  def test_none_where_nothing_divides(self, m_shard, k, n_shard):
    self.assertIsNone(ring_config.default_ring_config(shard_problem(m_shard, k, n_shard),
                                                      jnp.float16))

  def test_rings_refuse_clusters(self):
    """The rings launch blocks without clusters, so a config with cluster_m=2
    is refused before anything is traced, by both rings."""
    problem = shard_problem(512, 4096, 4096)
    config = dataclasses.replace(ring_config.default_ring_config(problem, jnp.float16),
                                 cluster_m=2)
    with self.assertRaisesRegex(ValueError, "cluster_m=2: the all-gather ring runs blocks"):
      ring_matmul_sm90.check_ring_config(config, problem, jnp.float16)
    with self.assertRaisesRegex(ValueError, "cluster_m=2: the reduce-scatter ring runs blocks"):
      ring_reduce_scatter_sm90.check_reduce_scatter_config(config, problem, jnp.float16)

  def test_every_candidate_is_a_cooperative_tile_with_64_column_segments(self):
    for tiles in ring_config.RING_TILES:
      self.assertEqual(tiles.schedule, Schedule.COOPERATIVE)
      self.assertIn(tiles.cta_tile_m, (64, 128))
      self.assertEqual(tiles.cta_tile_n % 64, 0, f"{tiles}")


if __name__ == "__main__":
  absltest.main()
