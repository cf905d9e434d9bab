"""Which implementation `all_gather_matmul` takes, and why, with the facts mocked.

No kernel runs: the decision is checked directly (`decide_implementation`),
and through the dispatcher traced under `jax.shard_map` with the Mosaic ring's
support mocked and its kernel entry replaced by a recorder.
"""

import logging
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized

import collectives
from collectives import portable, ring_config, ring_matmul_sm90, sharding, topology
from core import interpret
from pipelines import MatmulDimension, TuningConfig
from pipelines.operands import MatmulProblem

Impl = collectives.Implementation
SUPPORTED = topology.RingSupport(True, "one process drives all GPUs (mocked)")
UNSUPPORTED = topology.RingSupport(False, "one process per GPU needs NVSHMEM (mocked)")
F16 = jnp.dtype(jnp.float16)


def shard_problem(m_shard, k, n_shard):
  return MatmulProblem(m=m_shard, k=k, n=n_shard, dtype=F16)


def decide(requested="auto", *, num_devices=2, support=SUPPORTED, on_gpu=True, shape=None,
           config=None):
  problem = shard_problem(*shape) if shape else None
  return collectives.decide_implementation(requested, num_devices=num_devices, support=support,
                                           on_gpu=on_gpu, problem=problem, out_dtype=F16,
                                           config=config)


class DecisionTest(parameterized.TestCase):
  """`decide_implementation` as a pure function of the facts."""

  @parameterized.parameters((128, 512, 576), (256, 256, 64), (4096, 512, 576))
  def test_auto_takes_the_ring_with_a_config_that_divides_the_shards(self, *shape):
    choice = decide(shape=shape)
    self.assertEqual(choice.implementation, Impl.MOSAIC)
    self.assertEqual(choice.reason, SUPPORTED.reason)
    self.assertTrue(ring_config.divides(choice.config, shard_problem(*shape)), choice.config)

  @parameterized.parameters((72, 512, 256), (1000, 512, 256), (64, 512, 64))
  def test_auto_falls_back_where_no_ring_config_divides(self, *shape):
    m_shard, _, n_shard = shape
    on_cpu = decide(shape=shape, on_gpu=False)
    self.assertEqual(on_cpu.implementation, Impl.XLA_RING)
    self.assertIn(f"M_shard={m_shard} and N_shard={n_shard}", on_cpu.reason)
    # On GPUs the XLA ring measured slower than the all-gather + dot it replaces.
    on_gpu = decide(shape=shape, on_gpu=True)
    self.assertEqual(on_gpu.implementation, Impl.XLA_ALL_GATHER)
    self.assertIn(f"M_shard={m_shard} and N_shard={n_shard}", on_gpu.reason)

  def test_auto_falls_back_from_a_given_config_the_ring_cannot_run(self):
    config = TuningConfig(tile_m=64, tile_n=256, wg_dimension=MatmulDimension.M)
    choice = decide(shape=(128, 512, 576), on_gpu=False, config=config)
    self.assertEqual(choice.implementation, Impl.XLA_RING)
    self.assertIn("N_shard (rhs.shape[1])=576 must be a multiple of the CTA tile 256",
                  choice.reason)

  def test_auto_without_the_ring_on_gpus_takes_all_gather_then_dot(self):
    choice = decide(support=UNSUPPORTED, on_gpu=True, shape=(1024, 4096, 4096))
    self.assertEqual(choice.implementation, Impl.XLA_ALL_GATHER)
    self.assertIn(UNSUPPORTED.reason, choice.reason)
    self.assertIn("0.78x", choice.reason)

  def test_auto_without_the_ring_on_cpus_takes_the_xla_ring(self):
    choice = decide(support=UNSUPPORTED, on_gpu=False, shape=(1024, 4096, 4096))
    self.assertEqual((choice.implementation, choice.reason), (Impl.XLA_RING, UNSUPPORTED.reason))

  def test_auto_on_one_device_takes_the_local_matmul(self):
    self.assertEqual(decide(num_devices=1, shape=(72, 512, 100)).implementation, Impl.LOCAL)

  def test_only_mosaic_refuses(self):
    with self.assertRaisesRegex(NotImplementedError, "implementation='mosaic': no CTA tile "
                                "the ring can run divides M_shard=72 and N_shard=256"):
      decide("mosaic", shape=(72, 512, 256))
    for shape in ((72, 512, 256), (1000, 512, 256), (128, 512, 576), (128, 200, 128)):
      for support in (SUPPORTED, UNSUPPORTED):
        for on_gpu in (False, True):
          decide(shape=shape, support=support, on_gpu=on_gpu)  # Never raises.

  @parameterized.parameters(2, 8)
  def test_local_on_several_devices_raises(self, num_devices):
    with self.assertRaisesRegex(ValueError, f"implementation='local' runs the plain matmul on "
                                f"one device, but the mesh axis has {num_devices} devices"):
      decide("local", num_devices=num_devices, shape=(128, 512, 256))
    self.assertEqual(decide("local", num_devices=1).implementation, Impl.LOCAL)

  def test_forced_xla_paths(self):
    for name in ("xla_ring", "xla_all_gather"):
      self.assertEqual(decide(name, shape=(72, 512, 256)),
                       decide(name, support=UNSUPPORTED, on_gpu=False))
      self.assertEqual(decide(name).implementation, Impl(name))

  def test_unknown_name_lists_the_valid_ones(self):
    with self.assertRaisesRegex(ValueError, "implementation='ring' is not one of "
                                r"\('auto', 'mosaic', 'local', 'xla_ring', 'xla_all_gather'\)"):
      decide("ring")


class DispatchTest(parameterized.TestCase):
  """`all_gather_matmul` traced with the ring's support mocked; no kernel runs."""

  num_devices = 2

  def setUp(self):
    super().setUp()
    if jax.device_count() < self.num_devices:
      self.skipTest(f"needs {self.num_devices} devices, the job has {jax.device_count()}: "
                    "run with XLA_FLAGS=--xla_force_host_platform_device_count=8")
    self.ring_configs = []

    def ring_kernel(lhs, rhs, axis_name, *, config, dtype):
      self.ring_configs.append(config)
      return portable.all_gather_then_matmul(lhs, rhs, axis_name, dtype=dtype)

    self.enter_context(mock.patch.object(ring_matmul_sm90, "all_gather_lhs_matmul",
                                         side_effect=ring_kernel))
    self.xla_ring = self.enter_context(mock.patch.object(
        portable, "ring_all_gather_matmul", wraps=portable.ring_all_gather_matmul))
    self.all_gather = self.enter_context(mock.patch.object(
        portable, "all_gather_then_matmul", wraps=portable.all_gather_then_matmul))
    # The recorder stands in for the ring kernel, so interpret mode may "run" it
    # without the simulator; one test takes the simulator away.
    self.can_interpret_collectives = self.enter_context(mock.patch.object(
        interpret, "can_interpret_collectives", return_value=True))

  def trace(self, m_shard, k, n_shard, *, support, backend=None, **kwargs):
    """Traces `all_gather_matmul` and returns its debug log."""
    d = self.num_devices
    mesh = sharding.ring_mesh(d)
    args = sharding.abstract_operands(jax.ShapeDtypeStruct((d * m_shard, k), F16),
                                      jax.ShapeDtypeStruct((k, d * n_shard), F16), mesh)
    run = sharding.ring_matmul_fn(collectives.all_gather_matmul, mesh, **kwargs)
    with mock.patch.object(topology, "mosaic_ring_support", return_value=support), \
        mock.patch.object(jax, "default_backend", return_value=backend or "cpu"), \
        self.assertLogs("collectives", logging.DEBUG) as logs:
      out = jax.eval_shape(run, *args)
    self.assertEqual(out.shape, (d * m_shard, d * n_shard))
    return "\n".join(logs.output)

  def test_auto_runs_the_ring_on_shards_only_narrow_tiles_divide(self):
    log = self.trace(128, 256, 576, support=SUPPORTED)
    (config,) = self.ring_configs
    self.assertEqual(576 % config.cta_tile_n, 0, config)
    self.assertEqual(128 % config.cta_tile_m, 0, config)
    self.assertIn(": mosaic (", log)
    self.xla_ring.assert_not_called()

  def test_auto_takes_the_xla_ring_and_says_why_where_no_tile_divides(self):
    log = self.trace(72, 256, 256, support=SUPPORTED)
    self.assertEqual(self.ring_configs, [])
    self.xla_ring.assert_called_once()
    self.assertIn("xla_ring (no CTA tile the ring can run divides M_shard=72", log)

  def test_auto_on_gpus_without_the_ring_takes_all_gather_then_dot(self):
    log = self.trace(128, 256, 256, support=UNSUPPORTED, backend="gpu")
    self.assertEqual(self.ring_configs, [])
    self.xla_ring.assert_not_called()
    self.all_gather.assert_called_once()
    self.assertIn(f"xla_all_gather ({UNSUPPORTED.reason}", log)

  def test_local_on_several_devices_raises(self):
    with self.assertRaisesRegex(ValueError, "mesh axis has 2 devices"):
      self.trace(128, 256, 256, support=SUPPORTED, implementation="local")
    self.assertEqual(self.ring_configs, [])

  def test_mosaic_refuses_shards_no_config_divides(self):
    with self.assertRaisesRegex(NotImplementedError, "M_shard=1000"):
      self.trace(1000, 256, 256, support=SUPPORTED, implementation="mosaic")

  def test_simulated_ring_needs_the_collective_interpreter(self):
    self.can_interpret_collectives.return_value = False
    with interpret.interpret_mode(), \
        self.assertRaisesRegex(NotImplementedError, "collective_interpret_mode"):
      self.trace(128, 256, 256, support=SUPPORTED, implementation="mosaic")
    self.assertEqual(self.ring_configs, [])


if __name__ == "__main__":
  absltest.main()
