"""The Mosaic ring kernel across devices: real GPUs (multi_gpu tag) or simulated CPU devices.

On CPU the kernel runs in GPU interpret mode extended with semaphores and
peer memory (`simulator`) on 2 and 4 of the 8 simulated
devices, with race detection across devices; two planted bugs must be
caught: receivers that do not wait for the signal, and a sender that signals
before its copies have landed. On GPUs it runs over every
GPU of the host (one process for all of them) at the reference problem size.
"""

import dataclasses

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized

import collectives
import simulator
from collectives import collective_test_base, ring_matmul_sm90, sharding
from core import testing
from pipelines import MatmulDimension, TuningConfig, matmul_reference

# XLA sizes its CPU thread pool when jax starts the CPU backend, which no
# import above does: size it for the simulated rings' waiting threads.
simulator.reserve_intra_op_threads()

SMALL = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, epi_tile_m=64,
                     epi_tile_n=32, grid_tile_width=2, wg_dimension=MatmulDimension.M)


def ring_problem(num_devices, m_shard, k, n_shard, dtype, config, seed=0):
  """(the jitted ring over `num_devices` devices, its placed operands, lhs, rhs)."""
  mesh = sharding.ring_mesh(num_devices)
  lhs = testing.random_array(seed, (num_devices * m_shard, k), dtype)
  rhs = testing.random_array(seed + 1, (k, num_devices * n_shard), dtype)
  run = sharding.ring_matmul_fn(collectives.all_gather_lhs_matmul, mesh, config=config)
  return run, sharding.place_operands(lhs, rhs, mesh), lhs, rhs


class MosaicRingAllGatherTest(collective_test_base.SimulatedRingTestCase,
                              collective_test_base.CollectiveMatmulTestBase):
  """The shared cases on the Mosaic ring kernel: simulated devices on CPU, every GPU
  of the host on GPUs (the ring spans the job, so other sizes skip there). Two
  devices: the 4-device ring runs in `RingKernelTest`."""

  # Two 128-row M tiles and two 64-wide N tiles of SMALL per device.
  shard = (256, 128, 128)
  device_counts = (2,)

  def run_ring(self, d, lhs, rhs, **kwargs):
    self.spanning_ring(d)
    return super().run_ring(d, lhs, rhs, **kwargs)

  def implementation(self, lhs, rhs, axis_name, *, dtype=None):
    return collectives.all_gather_lhs_matmul(lhs, rhs, axis_name, config=SMALL, dtype=dtype)


class RingKernelTest(collective_test_base.SimulatedRingTestCase):

  @parameterized.product(num_devices=[2, 4], wg_dimension=list(MatmulDimension))
  def test_simulated_ring_matches_reference(self, num_devices, wg_dimension):
    self.simulated_devices(num_devices)
    config = dataclasses.replace(SMALL, wg_dimension=wg_dimension)
    # Two M tiles and two N tiles per device: several blocks send, and the
    # N tiles of each M band share its forwarding.
    m_shard, n_shard = 2 * config.cta_tile_m, 2 * config.cta_tile_n
    run, args, lhs, rhs = ring_problem(num_devices, m_shard, 128, n_shard, jnp.float16,
                                       config)
    out = self.run_kernel(run, *args)
    self.assertEqual(out.shape, (num_devices * m_shard, num_devices * n_shard))
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)

  @parameterized.named_parameters(
      # The receiver reads its scratch slots without waiting for the signal.
      ("receiver_does_not_wait", ring_matmul_sm90.pl, "semaphore_wait",
       lambda *args, **kwargs: None),
      # The sender signals before its copies have landed.
      ("sender_signals_before_copies_land", ring_matmul_sm90.plgpu, "wait_smem_to_gmem",
       collective_test_base.signals_before_landing(ring_matmul_sm90.plgpu)),
  )
  def test_planted_race_is_caught(self, module, name, replacement):
    self.simulated_devices(2)
    run, args, _, _ = ring_problem(2, 128, 128, 64, jnp.float16, SMALL, seed=5)
    self.check_planted_race(module, name, replacement, run, args)

  def test_all_gpus_at_the_reference_size(self):
    if self.backend != testing.GPU:
      self.skipTest("the reference size runs on GPUs only")
    config = TuningConfig(tile_m=64, tile_n=256, tile_k=64, max_concurrent_steps=3,
                          epi_tile_n=128, wg_dimension=MatmulDimension.M)
    run, args, lhs, rhs = ring_problem(jax.device_count(), 1024, 4096, 4096, jnp.float16,
                                       config)
    out = self.run_kernel(run, *args)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)


if __name__ == "__main__":
  absltest.main()
