"""The Mosaic matmul + reduce-scatter ring across devices: real GPUs (multi_gpu tag) or simulated.

On CPU the kernel runs in GPU interpret mode extended with semaphores and
peer memory (`simulator`) on 2 and 4 of the 8 simulated devices, with race
detection across devices; three planted bugs must be reported: receivers
that do not wait for the signal (a race), a sender that signals before its
stores have landed (a race), and a device whose own partial is added twice
(wrong numbers). On GPUs it runs over every GPU of the host (one process for
all of them) at a real problem size.
"""

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized

import simulator
from collectives import collective_test_base, sharding
from collectives import ring_reduce_scatter_sm90 as rs
from core import numerics, testing
from pipelines import MatmulDimension, TuningConfig, epilogue, matmul_reference
from pipelines.operands import MatmulProblem

# XLA sizes its CPU thread pool when jax starts the CPU backend, which no
# import above does: size it for the simulated rings' waiting threads.
simulator.reserve_intra_op_threads()

SMALL = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, epi_tile_m=64,
                     epi_tile_n=32, grid_tile_width=2, wg_dimension=MatmulDimension.M)


def ring_problem(num_devices, block_m, k_shard, n, dtype, config, seed=0, out_dtype=None):
  """(the jitted ring over `num_devices` devices, its placed operands, lhs, rhs)."""
  mesh = sharding.ring_mesh(num_devices)
  lhs = testing.random_array(seed, (num_devices * block_m, num_devices * k_shard), dtype)
  rhs = testing.random_array(seed + 1, (num_devices * k_shard, n), dtype)
  run = sharding.ring_matmul_fn(rs.ring_matmul_reduce_scatter, mesh, config=config,
                                      dtype=out_dtype, layout=sharding.REDUCE_SCATTER)
  return run, sharding.place_operands(lhs, rhs, mesh, sharding.REDUCE_SCATTER), lhs, rhs


class MosaicRingReduceScatterTest(collective_test_base.SimulatedRingTestCase,
                                  collective_test_base.CollectiveMatmulTestBase):
  """The shared cases on the Mosaic reduce-scatter ring: simulated devices on CPU, every
  GPU of the host on GPUs. Two devices: the 4-device ring runs in the tests below."""

  layout = sharding.REDUCE_SCATTER
  # One 128-row block of SMALL's CTA tiles and two 64-wide N tiles per device.
  shard = (128, 128, 128)
  device_counts = (2,)

  def run_ring(self, d, lhs, rhs, **kwargs):
    self.spanning_ring(d)
    return super().run_ring(d, lhs, rhs, **kwargs)

  def implementation(self, lhs, rhs, axis_name, *, dtype=None):
    return rs.ring_matmul_reduce_scatter(lhs, rhs, axis_name, config=SMALL, dtype=dtype)


class RingReduceScatterKernelTest(collective_test_base.SimulatedRingTestCase):


  @parameterized.product(num_devices=[2, 4], wg_dimension=list(MatmulDimension))
  def test_simulated_ring_matches_reference(self, num_devices, wg_dimension):
    self.simulated_devices(num_devices)
    config = dataclasses.replace(SMALL, wg_dimension=wg_dimension)
    # Two M tiles and two N tiles per block, on 4 persistent blocks: every
    # warpgroup of every block stores to the peer and signals.
    block_m, n = 2 * config.cta_tile_m, 2 * config.cta_tile_n
    run, args, lhs, rhs = ring_problem(num_devices, block_m, 128, n, jnp.float16, config)
    out = self.run_kernel(run, *args)
    self.assertEqual((out.shape, out.dtype), ((num_devices * block_m, n), jnp.float16))
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)

  def test_simulated_ring_with_another_output_dtype(self):
    self.simulated_devices(2)
    run, args, lhs, rhs = ring_problem(2, 128, 192, 64, jnp.float16, SMALL, seed=3,
                                       out_dtype=jnp.bfloat16)
    out = self.run_kernel(run, *args)
    self.assertEqual(out.dtype, jnp.bfloat16)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.bfloat16)

  @parameterized.named_parameters(
      # The receiver reads its scratch slots without waiting for the signal.
      ("receiver_does_not_wait", rs.pl, "semaphore_wait", lambda *args, **kwargs: None),
      # The sender signals before its stores have landed.
      ("sender_signals_before_copies_land", rs.plgpu, "wait_smem_to_gmem",
       collective_test_base.signals_before_landing(rs.plgpu)),
  )
  def test_planted_race_is_caught(self, module, name, replacement):
    self.simulated_devices(2)
    run, args, _, _ = ring_problem(2, 128, 128, 128, jnp.float16, SMALL, seed=5)
    self.check_planted_race(module, name, replacement, run, args)

  def test_planted_double_add_gives_wrong_numbers(self):
    """An epilogue that adds the received running sum twice: no race (the
    protocol is intact), but every block's sum is off by its partials."""
    self.simulated_devices(4)
    load = epilogue.plgpu.load

    def load_twice(ref, **kwargs):  # The epilogue's only load here is the addend's.
      return 2 * load(ref, **kwargs)

    with mock.patch.object(epilogue.plgpu, "load", load_twice):
      run, args, lhs, rhs = ring_problem(4, 128, 64, 64, jnp.float16, SMALL, seed=7)
      out = self.run_kernel(run, *args)
    # Finite (every element written) but far off: each block has its D - 1
    # received partials once too many.
    err = numerics.relative_error(out, matmul_reference(lhs, rhs))
    self.assertTrue(0.1 < err < float("inf"), f"relative error {err}: the double add was missed")

  def test_all_gpus_at_a_real_size(self):
    if self.backend != testing.GPU:
      self.skipTest("the real size runs on GPUs only (hours in the interpreter)")
    num_devices = jax.device_count()
    block_m, k_shard, n = 1024, 2048, 4096
    config = rs.ring_reduce_scatter_config(
        MatmulProblem(m=block_m, k=k_shard, n=n, dtype=jnp.dtype(jnp.bfloat16)), jnp.bfloat16)
    self.assertIsNotNone(config)
    run, args, lhs, rhs = ring_problem(num_devices, block_m, k_shard, n, jnp.bfloat16, config)
    out = self.run_kernel(run, *args)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.bfloat16)


if __name__ == "__main__":
  absltest.main()
