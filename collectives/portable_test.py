"""The XLA ring and the dispatcher on simulated CPU devices (and on GPUs, multi_gpu tag)."""

import logging

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized

import collectives
from collectives import collective_test_base, sharding
from core import testing
from pipelines import matmul_reference


def global_operands(seed, d, m_shard, k, n_shard, dtype):
  return (testing.random_array(seed, (d * m_shard, k), dtype),
          testing.random_array(seed + 1, (k, d * n_shard), dtype))


class XlaRingAllGatherTest(collective_test_base.CollectiveMatmulTestBase):
  """The shared cases on the XLA ring (`ring_all_gather_matmul`)."""

  def implementation(self, lhs, rhs, axis_name, *, dtype=None):
    return collectives.ring_all_gather_matmul(lhs, rhs, axis_name, dtype=dtype)


class AllGatherThenMatmulTest(collective_test_base.CollectiveMatmulTestBase):
  """The shared cases on the naive form (`all_gather_then_matmul`)."""

  def implementation(self, lhs, rhs, axis_name, *, dtype=None):
    return collectives.all_gather_then_matmul(lhs, rhs, axis_name, dtype=dtype)


class PortableRingTest(testing.KernelTestCase):

  def run_ring(self, fn, d, lhs, rhs, **kwargs):
    if d > jax.device_count():
      self.skipTest(f"needs {d} devices, the job has {jax.device_count()}")
    mesh = sharding.ring_mesh(d)
    return sharding.ring_matmul_fn(fn, mesh, **kwargs)(
        *sharding.place_operands(lhs, rhs, mesh))

  @parameterized.parameters(2, 4, 8)
  def test_ring_equals_gather_then_matmul(self, d):
    lhs, rhs = global_operands(10 + d, d, 32, 64, 16, jnp.bfloat16)
    ring = self.run_ring(collectives.ring_all_gather_matmul, d, lhs, rhs, dtype=jnp.float16)
    naive = self.run_ring(collectives.all_gather_then_matmul, d, lhs, rhs, dtype=jnp.float16)
    self.assertEqual(ring.dtype, jnp.float16)
    self.assert_close(ring, naive, dtype=jnp.float16)
    self.assert_close(naive, matmul_reference(lhs, rhs), dtype=jnp.float16)

  def test_dispatch_without_peer_access_takes_the_xla_ring_and_logs_it(self):
    if jax.default_backend() == "gpu":
      self.skipTest("on GPUs the dispatcher takes the Mosaic kernel (ring_matmul tests)")
    lhs, rhs = global_operands(3, 4, 32, 64, 16, jnp.float16)
    with self.assertLogs("collectives", logging.DEBUG) as logs:
      out = self.run_ring(collectives.all_gather_matmul, 4, lhs, rhs)
    self.assertIn("xla_ring", "\n".join(logs.output))
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)

  def test_choice_names_the_reason(self):
    choice = collectives.choose_implementation(jax.device_count())
    if jax.default_backend() != "gpu":
      self.assertEqual(choice.implementation, collectives.Implementation.XLA_RING)
      self.assertIn("not a GPU", choice.reason)
    forced = collectives.choose_implementation(2, "xla_ring")
    self.assertEqual(forced.implementation, collectives.Implementation.XLA_RING)


class ValidationTest(parameterized.TestCase):
  """Bad input fails with an error naming the argument, at trace time."""

  def trace(self, fn, lhs, rhs, **kwargs):
    mesh = sharding.ring_mesh(min(2, jax.device_count()))
    jax.eval_shape(sharding.ring_matmul_fn(fn, mesh, **kwargs),
                   *sharding.abstract_operands(lhs, rhs, mesh))

  @parameterized.parameters(collectives.ring_all_gather_matmul, collectives.all_gather_matmul,
                            collectives.all_gather_then_matmul)
  def test_errors(self, fn):
    s = jax.ShapeDtypeStruct
    with self.assertRaisesRegex(ValueError, "K of lhs and rhs differ"):
      self.trace(fn, s((128, 64), jnp.float16), s((128, 64), jnp.float16))
    with self.assertRaisesRegex(ValueError, "lhs.dtype=float32 is not supported"):
      self.trace(fn, s((128, 64), jnp.float32), s((64, 64), jnp.float32))
    with self.assertRaisesRegex(ValueError, "dtype=float32 is not supported"):
      self.trace(fn, s((128, 64), jnp.float16), s((64, 64), jnp.float16), dtype=jnp.float32)

  def test_axis_must_be_in_scope(self):
    lhs = jnp.ones((16, 64), jnp.float16)
    with self.assertRaisesRegex(ValueError, "axis_name='x' is not a mesh axis in scope"):
      collectives.all_gather_matmul(lhs, lhs.T, "x")

  def test_unknown_implementation_lists_the_valid_ones(self):
    with self.assertRaisesRegex(ValueError, "implementation='fastest' is not one of "
                                r"\('auto', 'mosaic', 'local', 'xla_ring', 'xla_all_gather'\)"):
      collectives.choose_implementation(2, "fastest")


if __name__ == "__main__":
  absltest.main()
