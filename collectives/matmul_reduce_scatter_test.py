"""`matmul_reduce_scatter`: its choice with the facts mocked, the seam to the Mosaic kernel,
and the XLA ring and naive form on simulated CPU devices (and on GPUs, multi_gpu tag)."""

import importlib
import importlib.util
import logging
import types
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized

import collectives
from collectives import collective_test_base, portable, sharding, topology
from core import interpret, testing
from pipelines import MatmulDimension, TuningConfig, matmul_reference
from pipelines.operands import MatmulProblem

# The dispatch module: the package's name `matmul_reduce_scatter` is the function.
dispatch_module = importlib.import_module("collectives.matmul_reduce_scatter")

Impl = collectives.Implementation
SUPPORTED = topology.RingSupport(True, "one process drives all GPUs (mocked)")
UNSUPPORTED = topology.RingSupport(False, "one process per GPU needs NVSHMEM (mocked)")
F16 = jnp.dtype(jnp.float16)
KERNEL_CONFIG = TuningConfig(tile_m=64, tile_n=64, wg_dimension=MatmulDimension.M)
# Captured before any test wraps it, so the stand-in kernel is not counted as the XLA ring.
XLA_RING = portable.xla_ring_matmul_reduce_scatter
VALID = r"\('auto', 'mosaic', 'local', 'xla_ring', 'xla_reduce_scatter'\)"


def fake_kernel(*, config=KERNEL_CONFIG, calls=None):
  """A stand-in for `ring_reduce_scatter_sm90`: the XLA ring, recording its configs."""
  def ring_matmul_reduce_scatter(lhs, rhs, axis_name, *, config, dtype=None):
    if calls is not None:
      calls.append(config)
    return XLA_RING(lhs, rhs, axis_name, dtype=dtype)

  return types.SimpleNamespace(ring_matmul_reduce_scatter=ring_matmul_reduce_scatter,
                               ring_reduce_scatter_config=lambda problem, out_dtype: config,
                               check_reduce_scatter_config=lambda *_: None)


def block_problem(m_block, k_shard, n):
  return MatmulProblem(m=m_block, k=k_shard, n=n, dtype=F16)


def decide(requested="auto", *, num_devices=2, support=SUPPORTED, on_gpu=True,
           shape=(128, 256, 256), config=None):
  return collectives.decide_reduce_scatter_implementation(
      requested, num_devices=num_devices, support=support, on_gpu=on_gpu,
      problem=block_problem(*shape) if shape else None, out_dtype=F16, config=config)


class DecisionTest(parameterized.TestCase):
  """The decision as a pure function of the facts, the kernel's config function mocked."""

  def setUp(self):
    super().setUp()
    self.kernel = self.enter_context(mock.patch.object(dispatch_module, "ring_kernel",
                                                       return_value=fake_kernel()))

  def test_auto_takes_the_ring_with_the_kernels_config(self):
    choice = decide()
    self.assertEqual((choice.implementation, choice.config), (Impl.MOSAIC, KERNEL_CONFIG))
    self.assertEqual(choice.reason, SUPPORTED.reason)

  def test_auto_falls_back_where_the_kernel_has_no_config(self):
    self.kernel.return_value = fake_kernel(config=None)
    on_cpu = decide(on_gpu=False, shape=(72, 256, 100))
    self.assertEqual(on_cpu.implementation, Impl.XLA_RING)
    self.assertIn("M / D=72 rows, K_shard=256, N=100", on_cpu.reason)
    on_gpu = decide(on_gpu=True, shape=(72, 256, 100))
    self.assertEqual(on_gpu.implementation, Impl.XLA_REDUCE_SCATTER)
    self.assertIn("NCCL reduce-scatter + one dot", on_gpu.reason)
    with self.assertRaisesRegex(NotImplementedError, "implementation='mosaic': the "
                                "reduce-scatter ring has no config"):
      decide("mosaic", shape=(72, 256, 100))

  def test_auto_without_the_ring(self):
    self.assertEqual(decide(support=UNSUPPORTED, on_gpu=True).implementation,
                     Impl.XLA_REDUCE_SCATTER)
    choice = decide(support=UNSUPPORTED, on_gpu=False)
    self.assertEqual((choice.implementation, choice.reason), (Impl.XLA_RING, UNSUPPORTED.reason))

  def test_a_given_config_goes_to_the_kernel(self):
    config = TuningConfig(tile_m=64, tile_n=128, wg_dimension=MatmulDimension.N)
    self.assertEqual(decide(config=config).config, config)

  def test_one_device_and_forced_paths(self):
    self.assertEqual(decide(num_devices=1).implementation, Impl.LOCAL)
    for name in ("xla_ring", "xla_reduce_scatter"):
      self.assertEqual(decide(name, support=UNSUPPORTED).implementation, Impl(name))
    with self.assertRaisesRegex(ValueError, "implementation='local' runs the plain matmul on "
                                "one device, but the mesh axis has 4 devices"):
      decide("local", num_devices=4)

  def test_unknown_names_list_the_valid_ones(self):
    for name in ("ring", "xla_all_gather"):
      with self.assertRaisesRegex(ValueError, f"implementation='{name}' is not one of {VALID}"):
        decide(name)
    with self.assertRaisesRegex(ValueError, "implementation='xla_reduce_scatter' is not one of "
                                r"\('auto', 'mosaic', 'local', 'xla_ring', 'xla_all_gather'\)"):
      collectives.choose_implementation(2, "xla_reduce_scatter")


class DispatchTest(parameterized.TestCase):
  """`matmul_reduce_scatter` traced on 2 of 8 CPU devices, the kernel and its support mocked."""

  num_devices = 2

  def setUp(self):
    super().setUp()
    if jax.device_count() < self.num_devices:
      self.skipTest(f"needs {self.num_devices} devices, the job has {jax.device_count()}: "
                    "run with XLA_FLAGS=--xla_force_host_platform_device_count=8")
    self.kernel_configs = []
    self.kernel = self.enter_context(mock.patch.object(
        dispatch_module, "ring_kernel", return_value=fake_kernel(calls=self.kernel_configs)))
    self.xla_ring = self.enter_context(mock.patch.object(
        portable, "xla_ring_matmul_reduce_scatter",
        wraps=portable.xla_ring_matmul_reduce_scatter))
    self.naive = self.enter_context(mock.patch.object(
        portable, "matmul_then_reduce_scatter", wraps=portable.matmul_then_reduce_scatter))
    self.enter_context(mock.patch.object(interpret, "can_interpret_collectives",
                                         return_value=True))

  def trace(self, m, k_shard, n, *, support=SUPPORTED, backend="cpu", **kwargs):
    d = self.num_devices
    mesh = sharding.ring_mesh(d)
    layout = sharding.REDUCE_SCATTER
    args = sharding.abstract_operands(jax.ShapeDtypeStruct((m, d * k_shard), F16),
                                      jax.ShapeDtypeStruct((d * k_shard, n), F16), mesh, layout)
    run = sharding.ring_matmul_fn(collectives.matmul_reduce_scatter, mesh, layout=layout,
                                  **kwargs)
    with mock.patch.object(topology, "mosaic_ring_support", return_value=support), \
        mock.patch.object(jax, "default_backend", return_value=backend), \
        self.assertLogs("collectives", logging.DEBUG) as logs:
      out = jax.eval_shape(run, *args)
    self.assertEqual(out.shape, (m, n))
    return "\n".join(logs.output)

  def test_auto_runs_the_kernel_with_the_config_of_one_row_block(self):
    problems = []

    def config_for(problem, out_dtype):
      problems.append(problem)
      return KERNEL_CONFIG

    self.kernel.return_value.ring_reduce_scatter_config = config_for
    log = self.trace(256, 64, 128)
    self.assertEqual(problems, [block_problem(128, 64, 128)])
    self.assertEqual(self.kernel_configs, [KERNEL_CONFIG])
    self.assertIn("matmul_reduce_scatter over 2 devices of x: mosaic (", log)
    self.xla_ring.assert_not_called()

  def test_auto_without_the_ring_falls_back_and_says_why(self):
    log = self.trace(256, 64, 128, support=UNSUPPORTED)
    self.xla_ring.assert_called_once()
    self.assertIn(f"xla_ring ({UNSUPPORTED.reason})", log)
    log = self.trace(256, 64, 128, support=UNSUPPORTED, backend="gpu")
    self.naive.assert_called_once()
    self.assertIn(f"xla_reduce_scatter ({UNSUPPORTED.reason}", log)
    self.assertEqual(self.kernel_configs, [])

  def test_simulated_ring_needs_the_collective_interpreter(self):
    with mock.patch.object(interpret, "can_interpret_collectives", return_value=False), \
        interpret.interpret_mode(), \
        self.assertRaisesRegex(NotImplementedError, "collective_interpret_mode"):
      self.trace(256, 64, 128, implementation="mosaic")
    self.assertEqual(self.kernel_configs, [])


def global_operands(seed, m, d, k_shard, n, dtype):
  return (testing.random_array(seed, (m, d * k_shard), dtype),
          testing.random_array(seed + 1, (d * k_shard, n), dtype))


class XlaRingReduceScatterTest(collective_test_base.CollectiveMatmulTestBase):
  """The shared cases on the XLA ring (`xla_ring_matmul_reduce_scatter`)."""

  layout = sharding.REDUCE_SCATTER
  shard = (32, 64, 48)

  def implementation(self, lhs, rhs, axis_name, *, dtype=None):
    return collectives.xla_ring_matmul_reduce_scatter(lhs, rhs, axis_name, dtype=dtype)


class MatmulThenReduceScatterTest(collective_test_base.CollectiveMatmulTestBase):
  """The shared cases on the naive form (`matmul_then_reduce_scatter`)."""

  layout = sharding.REDUCE_SCATTER
  shard = (32, 64, 48)

  def implementation(self, lhs, rhs, axis_name, *, dtype=None):
    return collectives.matmul_then_reduce_scatter(lhs, rhs, axis_name, dtype=dtype)


class PortableReduceScatterTest(testing.KernelTestCase):
  """The XLA ring and the naive form against the float32 reference."""

  def run_op(self, fn, d, lhs, rhs, **kwargs):
    if d > jax.device_count():
      self.skipTest(f"needs {d} devices, the job has {jax.device_count()}")
    mesh = sharding.ring_mesh(d)
    layout = sharding.REDUCE_SCATTER
    run = sharding.ring_matmul_fn(fn, mesh, layout=layout, **kwargs)
    return self.run_kernel(run, *sharding.place_operands(lhs, rhs, mesh, layout))

  @parameterized.parameters(2, 4)
  def test_ring_equals_the_naive_form_in_another_output_dtype(self, d):
    lhs, rhs = global_operands(30 + d, d * 16, d, 32, 64, jnp.bfloat16)
    ring = self.run_op(collectives.xla_ring_matmul_reduce_scatter, d, lhs, rhs,
                       dtype=jnp.float16)
    naive = self.run_op(collectives.matmul_then_reduce_scatter, d, lhs, rhs, dtype=jnp.float16)
    self.assertEqual(ring.dtype, jnp.float16)
    self.assert_close(ring, naive, dtype=jnp.float16)
    self.assert_close(naive, matmul_reference(lhs, rhs), dtype=jnp.float16)

  def test_dispatch_on_cpu_takes_the_xla_ring_and_logs_it(self):
    if jax.default_backend() == "gpu":
      self.skipTest("on GPUs the dispatcher takes the Mosaic kernel or the naive form")
    lhs, rhs = global_operands(3, 128, 4, 32, 64, jnp.float16)
    with self.assertLogs("collectives", logging.DEBUG) as logs:
      out = self.run_op(collectives.matmul_reduce_scatter, 4, lhs, rhs)
    self.assertIn("matmul_reduce_scatter over 4 devices of x: xla_ring", "\n".join(logs.output))
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)


class ValidationTest(parameterized.TestCase):
  """Bad input fails with an error naming the argument, at trace time."""

  def trace(self, fn, lhs, rhs, d=2, **kwargs):
    mesh = sharding.ring_mesh(min(d, jax.device_count()))
    layout = sharding.REDUCE_SCATTER
    jax.eval_shape(sharding.ring_matmul_fn(fn, mesh, layout=layout, **kwargs),
                   *sharding.abstract_operands(lhs, rhs, mesh, layout))

  @parameterized.parameters(collectives.matmul_reduce_scatter,
                            collectives.xla_ring_matmul_reduce_scatter,
                            collectives.matmul_then_reduce_scatter)
  def test_errors(self, fn):
    s = jax.ShapeDtypeStruct
    d = min(4, jax.device_count())
    if d < 2:
      self.skipTest("an M that does not split needs a mesh of 2 or more devices")
    m = 32 * d + 1
    with self.assertRaisesRegex(ValueError, rf"M \(lhs.shape\[0\]\)={m} must be divisible by "
                                rf"the {d} devices of the mesh axis"):
      self.trace(fn, s((m, 128), jnp.float16), s((128, 64), jnp.float16), d=d)
    with self.assertRaisesRegex(ValueError, "K of lhs and rhs differ"):
      self.trace(fn, s((128, 64), jnp.float16), s((128, 64), jnp.float16))
    with self.assertRaisesRegex(ValueError, "lhs.dtype=float32 is not supported"):
      self.trace(fn, s((128, 64), jnp.float32), s((64, 64), jnp.float32))
    with self.assertRaisesRegex(ValueError, "dtype=float32 is not supported"):
      self.trace(fn, s((128, 64), jnp.float16), s((64, 64), jnp.float16), dtype=jnp.float32)
    with self.assertRaisesRegex(ValueError, "dtype=int8 is not supported .* as the output dtype"):
      self.trace(fn, s((128, 64), jnp.float16), s((64, 64), jnp.float16), dtype=jnp.int8)
    if fn is not collectives.matmul_then_reduce_scatter:  # It takes no config.
      for config in ("fast", dict(tile_m=64)):
        with self.assertRaisesRegex(ValueError, "config must be a TuningConfig, got"):
          self.trace(fn, s((128, 64), jnp.float16), s((64, 64), jnp.float16), config=config)

  def test_axis_must_be_in_scope(self):
    lhs = jnp.ones((16, 64), jnp.float16)
    with self.assertRaisesRegex(ValueError, "axis_name='x' is not a mesh axis in scope"):
      collectives.matmul_reduce_scatter(lhs, lhs.T, "x")


if __name__ == "__main__":
  absltest.main()
