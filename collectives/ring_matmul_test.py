"""The ring kernel's single-device parts, its lowering and its validation.

The LHS forwarding (`forward_lhs_tiles` with `delay_release`) runs here on one
device with a local destination; the ring itself, across devices, is
`ring_matmul_multi_gpu_test.py`.
"""

import dataclasses
import functools
import logging
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import collectives
from collectives import collective_test_base, ring_matmul_sm90, sharding, topology
from core import interpret, testing
from pipelines import (
  WG_AXIS,
  MatmulDimension,
  Schedule,
  TuningConfig,
  default_config,
  emit_cooperative_matmul,
  matmul_reference,
  persistent_kernel,
  ws_smem_budget,
)
from pipelines.operands import MatmulProblem

SMALL = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, epi_tile_m=64,
                     epi_tile_n=32, grid_tile_width=2, wg_dimension=MatmulDimension.M)


def matmul_forwarding_lhs(lhs, rhs, *, config: TuningConfig, num_blocks: int):
  """(lhs @ rhs, copy of lhs): the ring kernel's send path, aimed at a local buffer."""
  def body(lhs_gmem, rhs_gmem, out_gmem, lhs_copy_gmem):
    sender = jax.lax.axis_index(WG_AXIS) == ring_matmul_sm90.SENDER_WG
    forward = ring_matmul_sm90.forward_lhs_tiles(
        lhs_copy_gmem, cta_tile_m=config.cta_tile_m, tile_k=config.tile_k,
        n_tiles=rhs_gmem.shape[1] // config.cta_tile_n, enabled=sender)
    emit_cooperative_matmul(lhs_gmem, rhs_gmem, out_gmem, config=config,
                            pipeline_callback=forward,
                            delay_release=ring_matmul_sm90.SEND_DELAY_RELEASE)

  (m, k), n = lhs.shape, rhs.shape[1]
  return persistent_kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((m, n), lhs.dtype), jax.ShapeDtypeStruct((m, k), lhs.dtype)),
      num_blocks=num_blocks, name="matmul_forwarding_lhs",
  )(lhs, rhs)


class ForwardLhsTilesTest(testing.KernelTestCase):

  @parameterized.product(wg_dimension=list(MatmulDimension), num_blocks=[1, 3],
                         # 2 epilogue stores per tile, or 3 (odd: consecutive
                         # tiles start on different staging slots).
                         epilogue_tiling=[{}, dict(tile_n=192, epi_tile_n=64)],
                         # Fewer N tiles per M band than K steps (each sends
                         # some of them), as many, and more (some send none).
                         n_tiles=[2, 3, 4])
  def test_every_lhs_tile_is_forwarded_and_the_product_is_right(self, wg_dimension, num_blocks,
                                                               epilogue_tiling, n_tiles):
    # Several tiles per block: slots are reused across tiles while copies
    # may be in flight.
    config = dataclasses.replace(SMALL, wg_dimension=wg_dimension, **epilogue_tiling)
    lhs = testing.random_array(0, (256, 192), jnp.float16)
    rhs = testing.random_array(1, (192, n_tiles * config.cta_tile_n), jnp.float16)
    out, lhs_copy = self.run_kernel(
        functools.partial(matmul_forwarding_lhs, config=config, num_blocks=num_blocks),
        lhs, rhs)
    np.testing.assert_array_equal(np.asarray(lhs_copy), np.asarray(lhs))
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)

  def test_real_size(self):
    if self.backend != testing.GPU:
      self.skipTest("real sizes run on the GPU only (minutes in the interpreter)")
    config = TuningConfig(tile_m=64, tile_n=256, tile_k=64, max_concurrent_steps=3,
                          epi_tile_n=128, wg_dimension=MatmulDimension.M)
    lhs = testing.random_array(2, (1024, 4096), jnp.bfloat16)
    rhs = testing.random_array(3, (4096, 4096), jnp.bfloat16)
    out, lhs_copy = self.run_kernel(
        functools.partial(matmul_forwarding_lhs, config=config, num_blocks=132),
        lhs, rhs)
    np.testing.assert_array_equal(np.asarray(lhs_copy), np.asarray(lhs))
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.bfloat16)


class OneDeviceTest(collective_test_base.OneDeviceRingTestCase):

  def test_ring_kernel_on_one_device(self):
    mesh = sharding.ring_mesh(1)
    lhs = testing.random_array(4, (256, 128), jnp.bfloat16)
    rhs = testing.random_array(5, (128, 128), jnp.bfloat16)
    run = sharding.ring_matmul_fn(collectives.all_gather_lhs_matmul, mesh, config=SMALL)
    out = self.run_kernel(run, *sharding.place_operands(lhs, rhs, mesh))
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.bfloat16)

  def test_dispatch_on_one_gpu_takes_the_local_matmul(self):
    if self.backend != testing.GPU:
      self.skipTest("on CPU the dispatcher takes the XLA ring (portable_test)")
    mesh = sharding.ring_mesh(1)
    lhs = testing.random_array(6, (1024, 512), jnp.float16)
    rhs = testing.random_array(7, (512, 1024), jnp.float16)
    with self.assertLogs("collectives", logging.DEBUG) as logs:
      run = sharding.ring_matmul_fn(collectives.all_gather_matmul, mesh)
      out = self.run_kernel(run, *sharding.place_operands(lhs, rhs, mesh))
    self.assertIn("local", "\n".join(logs.output))
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)


def ring_spec(num_devices, m_shard, k, n_shard, dtype=jnp.float16):
  mesh = sharding.ring_mesh(num_devices)
  return mesh, sharding.abstract_operands(
      jax.ShapeDtypeStruct((num_devices * m_shard, k), dtype),
      jax.ShapeDtypeStruct((k, num_devices * n_shard), dtype), mesh)


def require_several_devices(test: absltest.TestCase) -> None:
  """Skips, saying why, where the job has one device: a ring of one is the plain matmul,
  which has none of the ring's lowering or configs to check."""
  if jax.device_count() < 2:
    test.skipTest(f"lowers a ring of several devices, the job has {jax.device_count()}: run "
                  "with XLA_FLAGS=--xla_force_host_platform_device_count=8 (as Bazel does)")


class LoweringAndValidationTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    # The default configs these cases check are those for 132 SMs, on any host.
    self.enter_context(testing.facts_of_the_fitted_gpu())


  def assert_gathers_inside_one_kernel(self, lowered_text):
    """One Mosaic GPU kernel and no XLA collective: the kernel moves the shards."""
    self.assertLen(re.findall(r"stablehlo\.custom_call @mosaic_gpu", lowered_text), 1)
    for op in ("all_gather", "collective_permute", "all_to_all", "all_reduce"):
      self.assertNotIn(f"stablehlo.{op}", lowered_text)

  def test_lowers_for_cuda_across_all_devices(self):
    """The full ring (remote refs, semaphores) lowers to one Mosaic GPU kernel on CPU."""
    if jax.default_backend() == "gpu":
      self.skipTest("the GPU tests run the kernel itself")
    num_devices = jax.device_count()
    require_several_devices(self)
    config = TuningConfig(tile_m=64, tile_n=256, tile_k=64, max_concurrent_steps=3,
                          epi_tile_n=128, wg_dimension=MatmulDimension.M)
    mesh, args = ring_spec(num_devices, 256, 512, 512)
    run = sharding.ring_matmul_fn(collectives.all_gather_lhs_matmul, mesh, config=config)
    supported = topology.RingSupport(True, "lowering only")
    with interpret.interpret_disabled(), mock.patch.object(
        topology, "mosaic_ring_support", return_value=supported):
      text = run.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    self.assert_gathers_inside_one_kernel(text)

  @parameterized.parameters(
      # A short, deep shard: the matmul heuristic splits K.
      ((256, 8192, 4096), "needs k_splits=1, not 4"),
      # A short K: the matmul heuristic takes the ping-pong schedule.
      ((4096, 1024, 6144), "needs schedule=Schedule.COOPERATIVE"),
      # The matmul heuristic's 128x128 tile masks the ragged last row band.
      ((320, 4096, 4096), "M_shard .* must be a multiple of the CTA tile 128"),
  )
  def test_default_config_is_one_the_ring_runs(self, shard_shape, plain_config_error):
    """Without a config, the ring takes `ring_config.default_ring_config`, where
    the plain matmul's heuristic config would be refused."""
    if jax.default_backend() == "gpu":
      self.skipTest("the GPU tests run the kernel itself")
    require_several_devices(self)
    m_shard, k, n_shard = shard_shape
    mesh, args = ring_spec(jax.device_count(), m_shard, k, n_shard)
    supported = topology.RingSupport(True, "lowering only")
    plain = default_config(MatmulProblem(m=m_shard, k=k, n=n_shard,
                                         dtype=jnp.dtype(jnp.float16)), jnp.float16)
    for config in (plain, None):
      run = sharding.ring_matmul_fn(collectives.all_gather_matmul, mesh, config=config,
                                    implementation="mosaic")
      with self.subTest(config=config), interpret.interpret_disabled(), mock.patch.object(
          topology, "mosaic_ring_support", return_value=supported):
        if config is None:
          text = run.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
          self.assert_gathers_inside_one_kernel(text)
        else:
          with self.assertRaisesRegex(ValueError, plain_config_error):
            run.trace(*args)

  def test_refuses_to_run_where_peers_are_unreachable(self):
    if jax.default_backend() == "gpu":
      self.skipTest("checks the CPU refusal")
    mesh, args = ring_spec(jax.device_count(), 128, 64, 64)
    run = sharding.ring_matmul_fn(collectives.all_gather_lhs_matmul, mesh, config=SMALL)
    with interpret.interpret_disabled(), self.assertRaisesRegex(
        NotImplementedError, "cannot run here: the backend is 'cpu'"):
      run.trace(*args)

  def test_one_process_per_gpu_without_nvshmem_falls_back_and_says_why(self):
    # A 4-GPU job of 4 processes, as this process would see it.
    with mock.patch.object(jax, "default_backend", return_value="gpu"), \
        mock.patch.object(jax, "device_count", return_value=4), \
        mock.patch.object(topology, "process_layout",
                          return_value=topology.ProcessLayout.ONE_PER_DEVICE), \
        mock.patch.object(topology, "nvshmem_available", return_value=False):
      support = topology.mosaic_ring_support(4)
      choice = collectives.choose_implementation(4)
    self.assertFalse(support.supported)
    self.assertIn("needs NVSHMEM", support.reason)
    # On GPUs the fallback is NCCL all-gather + one dot, which the XLA ring
    # did not beat there (0.78x in a job of one process per H200).
    self.assertEqual(choice.implementation, collectives.Implementation.XLA_ALL_GATHER)
    self.assertIn(support.reason, choice.reason)
    self.assertIn("0.78x", choice.reason)

  def test_smem_model_with_delayed_release(self):
    """The budget counts the tile-drained barrier that `delay_release` adds."""
    config = TuningConfig(tile_m=64, tile_n=256, tile_k=64, max_concurrent_steps=3,
                          epi_tile_n=128, wg_dimension=MatmulDimension.M)
    args = (jax.ShapeDtypeStruct((1024, 2048), jnp.float16),
            jax.ShapeDtypeStruct((2048, 1024), jnp.float16))
    fn = functools.partial(matmul_forwarding_lhs, config=config, num_blocks=8)
    problem = MatmulProblem(m=1024, k=2048, n=1024, dtype=jnp.dtype(jnp.float16))
    budget = ws_smem_budget(config, problem, jnp.float16,
                            delay_release=ring_matmul_sm90.SEND_DELAY_RELEASE)
    self.assertEqual(testing.mosaic_smem_bytes(fn, *args), budget.total_bytes)

  def test_bad_shapes_and_configs(self):
    cases = [
        ((100, 64, 64), SMALL, "M_shard .* must be a multiple of the CTA tile 128"),
        ((128, 64, 96), SMALL, "N_shard .* must be a multiple of the CTA tile 64"),
        ((128, 96, 64), SMALL, "K=96 must be a multiple of tile_k=64"),
        ((256, 4096, 512), TuningConfig(tile_m=64, tile_n=256, max_concurrent_steps=4,
                                        epi_tile_n=128, wg_dimension=MatmulDimension.M),
         "needs 262216 bytes of shared memory"),
        # The ring forwards LHS tiles from the cooperative pipeline's slots.
        ((128, 64, 64), dataclasses.replace(SMALL, schedule=Schedule.PINGPONG),
         "needs schedule=Schedule.COOPERATIVE"),
        # It forwards each tile's whole K loop, which a split K would share out.
        ((128, 128, 64), dataclasses.replace(SMALL, k_splits=2), "needs k_splits=1, not 2"),
    ]
    for (m_shard, k, n_shard), config, message in cases:
      mesh, args = ring_spec(1, m_shard, k, n_shard)
      run = sharding.ring_matmul_fn(collectives.all_gather_lhs_matmul, mesh, config=config)
      with self.subTest(message), interpret.interpret_mode(), \
          self.assertRaisesRegex(ValueError, message):
        run.trace(*args)


if __name__ == "__main__":
  absltest.main()
