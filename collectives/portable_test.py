"""The XLA ring and the dispatcher on simulated CPU devices (and on GPUs, multi_gpu tag)."""

import logging

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized
from jax.extend import core as jax_core

import collectives
from collectives import collective_test_base, portable, sharding
from core import testing
from pipelines import matmul_reference
from pipelines.operands import OperandLayout

XLA_RINGS = dict(all_gather=portable.ring_all_gather_matmul,
                 reduce_scatter=portable.xla_ring_matmul_reduce_scatter)


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


def dot_dependencies(jaxpr) -> list[set[int]]:
  """For each dot_general of `jaxpr`'s top level, in order, the earlier ones it depends on."""
  depends_on = {}  # var -> indices of the dots it was computed from
  dots = []
  for eqn in jaxpr.eqns:
    deps = set().union(*(depends_on.get(v, set()) for v in eqn.invars
                         if not isinstance(v, jax_core.Literal)))
    if eqn.primitive.name == "dot_general":
      dots.append(deps)
      deps = deps | {len(dots) - 1}
    for v in eqn.outvars:
      depends_on[v] = deps
  return dots


def ring_operands(op, d, *, m_shard=32, k=64, n_shard=16, global_shapes=False):
  """Zero (lhs, rhs) of a ring of d devices: one device's, or the global arrays."""
  if op == "all_gather":
    shapes = ((m_shard, k), (k, n_shard))
    scale = ((d, 1), (1, d))
  else:  # Per device lhs (D * M_shard, K_shard), rhs (K_shard, N); K is sharded.
    shapes = ((d * m_shard, k), (k, n_shard))
    scale = ((1, d), (d, 1))
  if global_shapes:
    shapes = [(rows * a, cols * b) for (rows, cols), (a, b) in zip(shapes, scale, strict=True)]
  return [jnp.zeros(shape, jnp.float16) for shape in shapes]


class XlaRingOverlapTest(parameterized.TestCase):
  """The XLA rings keep one dot per step, so that XLA can overlap each with a transfer.

  XLA's GPU compiler merges dots that share an operand (the RHS) and do not
  depend on each other into one dot, which then waits for every transfer.
  """

  @parameterized.product(op=list(XLA_RINGS), d=[2, 4])
  def test_each_step_dot_depends_on_the_previous_one(self, op, d):
    def ring(lhs, rhs):
      return XLA_RINGS[op](lhs, rhs, "x")

    jaxpr = jax.make_jaxpr(ring, axis_env=[("x", d)])(*ring_operands(op, d)).jaxpr
    dots = dot_dependencies(jaxpr)
    self.assertLen(dots, d)
    for step in range(1, d):
      self.assertIn(step - 1, dots[step], f"the dot of step {step} does not wait for step "
                    f"{step - 1}'s: XLA may merge them")

  @parameterized.parameters(*XLA_RINGS)
  def test_gpu_compiler_keeps_the_dots_apart(self, op):
    if jax.default_backend() != "gpu" or jax.device_count() < 2:
      self.skipTest("needs 2 GPUs: the dot merging happens in XLA's GPU compiler")
    mesh = sharding.ring_mesh(2)
    layout = dict(all_gather=sharding.ALL_GATHER, reduce_scatter=sharding.REDUCE_SCATTER)[op]
    # Large enough for XLA to call a GEMM.
    lhs, rhs = ring_operands(op, 2, m_shard=256, k=512, n_shard=256, global_shapes=True)
    run = sharding.ring_matmul_fn(XLA_RINGS[op], mesh, layout=layout)
    hlo = run.lower(*sharding.place_operands(lhs, rhs, mesh, layout)).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):].splitlines()
    # A dot is a cuBLAS call or a Triton GEMM fusion (merged: one of either).
    dots = [line for line in entry
            if "calls=%gemm_fusion" in line or 'custom_call_target="__cublas' in line]
    self.assertLen(dots, 2, "\n".join(dots))
    self.assertTrue(any("collective-permute-start" in line for line in entry),
                    "the ring's transfer is not asynchronous")


class XlaMatmulTest(parameterized.TestCase):
  """`xla_matmul`, the XLA paths' local product (the rings' per-step dots too)."""

  @parameterized.parameters((False, False), (True, False), (False, True), (True, True))
  def test_product_in_the_operand_dtype_is_the_dots_own(self, transpose_lhs, transpose_rhs):
    """As `jnp.dot` runs: a float32 product cast to bf16 makes cuBLAS write
    twice the bytes and XLA add a conversion pass. Another output dtype takes
    the float32 product, rounded once."""
    m, k, n = 16, 32, 48
    lhs = testing.random_array(60, (k, m) if transpose_lhs else (m, k), jnp.bfloat16)
    rhs = testing.random_array(61, (n, k) if transpose_rhs else (k, n), jnp.bfloat16)
    bf16, f32, f16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)
    for out_dtype, dot_dtypes in ((bf16, (bf16, bf16, bf16)), (f16, (bf16, bf16, f32)),
                                  (f32, (bf16, bf16, f32))):
      def product(a, b, out_dtype=out_dtype):
        return portable.xla_matmul(a, b, out_dtype=out_dtype, transpose_lhs=transpose_lhs,
                                   transpose_rhs=transpose_rhs)
      self.assertEqual(testing.dot_dtypes(product, lhs, rhs), [dot_dtypes], out_dtype)
      want = matmul_reference(lhs, rhs, layout=OperandLayout(transpose_lhs=transpose_lhs,
                                                             transpose_rhs=transpose_rhs))
      got = product(lhs, rhs)
      self.assertEqual((got.shape, got.dtype), ((m, n), out_dtype))
      self.assertLess(float(jnp.max(jnp.abs(got.astype(f32) - want))), 0.05 * float(
          jnp.max(jnp.abs(want))))


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
    with self.assertRaisesRegex(ValueError, "dtype=int8 is not supported .* as the output dtype"):
      self.trace(fn, s((128, 64), jnp.float16), s((64, 64), jnp.float16), dtype=jnp.int8)
    if fn is not collectives.all_gather_then_matmul:  # It takes no config.
      for config in ("fast", dict(tile_m=64)):
        with self.assertRaisesRegex(ValueError, "config must be a TuningConfig, got"):
          self.trace(fn, s((128, 64), jnp.float16), s((64, 64), jnp.float16), config=config)

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
