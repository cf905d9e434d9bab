"""The matmul + reduce-scatter ring: one device, its lowering, its validation and its config.

The ring across devices is `ring_reduce_scatter_multi_gpu_test.py`.
"""

import dataclasses
import re
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized

from collectives import collective_test_base, sharding, topology
from collectives import ring_reduce_scatter_sm90 as rs
from core import interpret, testing
from pipelines import MatmulDimension, Schedule, TuningConfig, matmul_reference
from pipelines.operands import MatmulProblem

SMALL = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, epi_tile_m=64,
                     epi_tile_n=32, grid_tile_width=2, wg_dimension=MatmulDimension.M)
# A config of real size; `ring_reduce_scatter_config` picks it for a 1024 x 2048 x 4096 block.
LARGE = TuningConfig(tile_m=64, tile_n=256, tile_k=64, max_concurrent_steps=3, epi_tile_n=64,
                     wg_dimension=MatmulDimension.M)


def reduce_scatter_spec(num_devices, block_m, k_shard, n, dtype=jnp.float16):
  mesh = sharding.ring_mesh(num_devices)
  return mesh, sharding.abstract_operands(
      jax.ShapeDtypeStruct((num_devices * block_m, num_devices * k_shard), dtype),
      jax.ShapeDtypeStruct((num_devices * k_shard, n), dtype), mesh, sharding.REDUCE_SCATTER)


class OneDeviceTest(collective_test_base.OneDeviceRingTestCase):

  def test_one_device_is_the_plain_matmul(self):
    mesh = sharding.ring_mesh(1)
    lhs = testing.random_array(4, (256, 192), jnp.bfloat16)
    rhs = testing.random_array(5, (192, 128), jnp.bfloat16)
    run = sharding.ring_matmul_fn(
        rs.ring_matmul_reduce_scatter, mesh, config=SMALL, layout=sharding.REDUCE_SCATTER)
    out = self.run_kernel(run, *sharding.place_operands(lhs, rhs, mesh, sharding.REDUCE_SCATTER))
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.bfloat16)


class LoweringAndValidationTest(parameterized.TestCase):

  def assert_reduces_inside_one_kernel(self, lowered_text):
    """One Mosaic GPU kernel and no XLA collective: the kernel moves the partials."""
    self.assertLen(re.findall(r"stablehlo\.custom_call @mosaic_gpu", lowered_text), 1)
    for op in ("all_gather", "collective_permute", "all_to_all", "all_reduce", "reduce_scatter"):
      self.assertNotIn(f"stablehlo.{op}", lowered_text)

  @parameterized.parameters(2, 8)
  def test_lowers_for_cuda_into_one_kernel(self, num_devices):
    """The ring (remote refs, semaphores, the addend) lowers to one Mosaic GPU
    kernel on CPU; 2 devices have no middle steps, 8 have a loop of them."""
    if jax.default_backend() == "gpu":
      self.skipTest("the GPU tests run the kernel itself")
    if num_devices > jax.device_count():
      self.skipTest(f"needs {num_devices} devices: run with "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh, args = reduce_scatter_spec(num_devices, 256, 512, 512)
    run = sharding.ring_matmul_fn(
        rs.ring_matmul_reduce_scatter, mesh, config=LARGE, layout=sharding.REDUCE_SCATTER)
    supported = topology.RingSupport(True, "lowering only")
    with interpret.interpret_disabled(), mock.patch.object(
        topology, "mosaic_ring_support", return_value=supported), mock.patch.object(
            jax, "device_count", return_value=num_devices):
      text = run.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    self.assert_reduces_inside_one_kernel(text)
    # The running sums travel in float16 on 2 devices, in float32 on more
    # (`partial_dtype`): the scratch slots are the kernel's second result.
    slots, partial = (1, "f16") if num_devices == 2 else (num_devices - 1, "f32")
    self.assertIn(f"tensor<{slots}x256x512x{partial}>", text)

  def test_refuses_to_run_where_peers_are_unreachable(self):
    if jax.default_backend() == "gpu":
      self.skipTest("checks the CPU refusal")
    mesh, args = reduce_scatter_spec(jax.device_count(), 128, 64, 64)
    run = sharding.ring_matmul_fn(
        rs.ring_matmul_reduce_scatter, mesh, config=SMALL, layout=sharding.REDUCE_SCATTER)
    with interpret.interpret_disabled(), self.assertRaisesRegex(
        NotImplementedError, "cannot run here: the backend is 'cpu'"):
      run.trace(*args)

  def test_axis_must_span_the_job(self):
    if jax.device_count() < 2:
      self.skipTest("needs a job of several devices")
    mesh, args = reduce_scatter_spec(1, 128, 64, 64)
    run = sharding.ring_matmul_fn(
        rs.ring_matmul_reduce_scatter, mesh, config=SMALL, layout=sharding.REDUCE_SCATTER)
    with interpret.interpret_disabled(), self.assertRaisesRegex(
        ValueError, "the ring must span every device"):
      run.trace(*args)

  def test_bad_shapes_dtypes_and_configs(self):
    # (devices, M, K_shard, N, dtype, out dtype, config, message): M is the
    # whole per-device LHS, M / D the block each step multiplies.
    cases = [
        (2, 201, 64, 64, jnp.float16, None, SMALL,
         r"M \(lhs.shape\[0\]=201\) must be a multiple of the 2 devices"),
        (2, 128, 64, 64, jnp.float16, None, SMALL,
         r"M / D \(lhs.shape\[0\] / devices\)=64 must be a multiple of the CTA tile 128"),
        (1, 128, 64, 96, jnp.float16, None, SMALL,
         r"N \(rhs.shape\[1\]\)=96 must be a multiple of the CTA tile 64"),
        (1, 128, 96, 64, jnp.float16, None, SMALL, "K=96 must be a multiple of tile_k=64"),
        (1, 128, 64, 64, jnp.float32, None, SMALL, "lhs.dtype=float32 is not supported"),
        (1, 128, 64, 64, jnp.float16, jnp.float32, SMALL,
         "dtype=float32 is not supported by the matmul \\+ reduce-scatter"),
        # Fits with 16-bit epilogue staging, not with the float32 partials'.
        (1, 256, 256, 256, jnp.float16, None,
         dataclasses.replace(LARGE, max_concurrent_steps=4),
         "bytes of shared memory"),
        (1, 128, 64, 64, jnp.float16, None,
         dataclasses.replace(SMALL, schedule=Schedule.PINGPONG),
         "runs the cooperative schedule|needs schedule=Schedule.COOPERATIVE"),
    ]
    for num_devices, m, k_shard, n, dtype, out_dtype, config, message in cases:
      # Validation needs no devices: a job of one GPU checks the 2-device cases too.
      mesh = sharding.abstract_ring_mesh(num_devices)
      args = sharding.abstract_operands(
          jax.ShapeDtypeStruct((m, num_devices * k_shard), dtype),
          jax.ShapeDtypeStruct((num_devices * k_shard, n), dtype), mesh, sharding.REDUCE_SCATTER)
      run = sharding.ring_matmul_fn(rs.ring_matmul_reduce_scatter, mesh, config=config,
                                          dtype=out_dtype, layout=sharding.REDUCE_SCATTER)
      with self.subTest(message), interpret.interpret_mode(), \
          self.assertRaisesRegex(ValueError, message):
        run.trace(*args)

  def test_outside_shard_map_names_the_axis(self):
    lhs = jnp.zeros((128, 64), jnp.float16)
    with self.assertRaisesRegex(ValueError, "axis_name='x' is not a mesh axis in scope"):
      rs.ring_matmul_reduce_scatter(lhs, jnp.zeros((64, 64), jnp.float16), "x", config=SMALL)


class ConfigTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    # The default configs these cases check are those for 132 SMs, on any host.
    self.enter_context(testing.facts_of_the_fitted_gpu())


  @parameterized.parameters(
      ((1024, 2048, 4096), jnp.bfloat16),
      ((512, 8192, 1024), jnp.float16),
      ((128, 1024, 576), jnp.bfloat16),  # Only 64-wide tiles divide N.
      ((64, 4096, 4096), jnp.float16),  # A block of one 64-row CTA tile.
  )
  def test_default_config_is_one_the_ring_runs(self, shape, dtype):
    m, k, n = shape
    block = MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(dtype))
    config = rs.ring_reduce_scatter_config(block, dtype)
    self.assertIsNotNone(config)
    rs.check_reduce_scatter_config(config, block, dtype)  # Does not raise.

  def test_real_size_config(self):
    block = MatmulProblem(m=1024, k=2048, n=4096, dtype=jnp.dtype(jnp.bfloat16))
    self.assertEqual(rs.ring_reduce_scatter_config(block, jnp.bfloat16), LARGE)

  def test_no_config_where_no_tile_divides(self):
    block = MatmulProblem(m=100, k=1024, n=1024, dtype=jnp.dtype(jnp.float16))
    self.assertIsNone(rs.ring_reduce_scatter_config(block, jnp.float16))


if __name__ == "__main__":
  absltest.main()
