"""bench_ragged_dot's problems: routings that sum to M, layers from published configs."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, flagsaver, parameterized

import simulator
from core import testing
from core.numerics import relative_error
from pipelines import matmul_test_base as base
from tools import bench_ragged_dot as bench
from tools import model_shapes

simulator.reserve_intra_op_threads()


class RoutingTest(parameterized.TestCase):

  @parameterized.product(layer=list(bench.LAYERS), routing=list(bench.ROUTINGS))
  def test_every_row_is_routed_once(self, layer, routing):
    sizes = bench.group_sizes(layer, routing)
    self.assertEqual(sizes.shape, (layer.groups,))
    self.assertEqual(int(sizes.sum()), layer.m)
    self.assertTrue(np.all(sizes >= 0), sizes)

  def test_skewed_is_uneven_and_fixed(self):
    layer = bench.LAYERS[0]
    first, second = (bench.group_sizes(layer, "skewed") for _ in range(2))
    np.testing.assert_array_equal(first, second)
    self.assertGreater(first.max(), 2 * first.min() + 1)

  def test_one_group_holds_every_row_and_unknown_routings_fail(self):
    layer = bench.LAYERS[0]
    sizes = bench.group_sizes(layer, "one_group")
    self.assertEqual(sizes[0], layer.m)
    with self.assertRaisesRegex(ValueError, "routing='even' must be one of"):
      bench.group_sizes(layer, "even")

  def test_unknown_flag_values_fail_before_anything_runs(self):
    # Checked before the GPU is looked for, so a typo fails on any machine.
    for flag, value in (("layers", "mixtral"), ("routings", "even"), ("impls", "cublas"),
                        ("passes", "backward_only")):
      with flagsaver.flagsaver(**{flag: [value]}), \
          self.assertRaisesRegex(SystemExit, f"--{flag}: unknown \\['{value}'\\]"):
        bench.main([])

  @parameterized.parameters(*bench.HALVES)
  def test_each_half_covers_few_large_and_many_small_experts_and_decode(self, half):
    layers = [layer for layer in bench.LAYERS if layer.half == half]
    groups = {layer.groups for layer in layers}
    self.assertLessEqual(min(groups), 8)
    self.assertGreaterEqual(max(groups), 60)
    self.assertTrue(any(layer.m <= 256 for layer in layers))
    self.assertGreaterEqual(len(layers), 6)

  def test_halves_share_no_family_and_agree_with_the_models_suite(self):
    families = {half: {layer.family for layer in bench.LAYERS if layer.half == half}
                for half in bench.HALVES}
    self.assertEmpty(families["fit"] & families["check"])
    for layer in bench.LAYERS:
      if layer.family in model_shapes.FIT_FAMILIES + model_shapes.CHECK_FAMILIES:
        self.assertEqual(layer.half, model_shapes.family_half(layer.family), layer.name)
    with self.assertRaisesRegex(ValueError, "neither"):
      bench.layer_half("Switch Transformer")

  def test_half_picks_the_layers_and_layers_overrides_it(self):
    check = bench.layers_to_time("check", None)
    self.assertIn("grok-1@2048", check)
    self.assertNotIn("mixtral-8x7b@8192", check)
    self.assertEqual(bench.layers_to_time("all", None), [layer.name for layer in bench.LAYERS])
    self.assertEqual(sorted(bench.layers_to_time("fit", None) + check),
                     sorted(layer.name for layer in bench.LAYERS))
    self.assertEqual(bench.layers_to_time("check", ["dbrx@4096"]), ["dbrx@4096"])


class TimedProductsTest(testing.KernelTestCase):
  """What the passes time is the product they name, on our kernels and on XLA."""

  def test_ours_dense_is_matmul_on_the_grouped_config(self):
    """What `ours_dense` times: the dense product, on `ragged_dot`'s config."""
    lhs = testing.random_array(2, (200, 128), jnp.bfloat16)
    rhs = testing.random_array(3, (128, 192), jnp.bfloat16)
    with base.with_blocks(2):
      got = self.run_kernel(jax.jit(bench.ours_dense), lhs, rhs)
    self.assert_close(got, jnp.dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32)),
                      dtype=jnp.bfloat16)

  def test_ours_dense_error_is_against_the_dense_product(self):
    """`ours_dense` ignores the routing, so its error is measured against
    lhs @ rhs[0] (against the grouped product it read 1.4 under balanced
    routing); the grouped implementations' against the ragged product."""
    lhs = testing.random_array(4, (200, 128), jnp.bfloat16)
    rhs = testing.random_array(5, (3, 128, 192), jnp.bfloat16)
    sizes = jnp.array([70, 100, 30], jnp.int32)
    want = bench.forward_references(lhs, rhs, sizes)
    with base.with_blocks(2):
      dense = self.run_kernel(jax.jit(bench.ours_dense), lhs, rhs[0])
      grouped = self.run_kernel(jax.jit(bench.implementations(None)["ours"]), lhs, rhs, sizes)
    self.assertLess(relative_error(dense, want["dense"]), 1e-2)
    self.assertLess(relative_error(grouped, want["grouped"]), 1e-2)
    self.assertGreater(relative_error(dense, want["grouped"]), 0.5)

  def test_references_are_xlas_ragged_products(self):
    """The float32 references multiply each group alone (XLA's float32
    `ragged_dot` on the GPU would need a (G, M, K) temporary): the same
    products, with an empty group and rows past the groups."""
    lhs = testing.random_array(6, (50, 32), jnp.bfloat16)
    rhs = testing.random_array(7, (4, 32, 24), jnp.bfloat16)
    g = testing.random_array(8, (50, 24), jnp.bfloat16)
    sizes = jnp.array([10, 0, 25, 7], jnp.int32)
    lhs32, rhs32, g32 = (x.astype(jnp.float32) for x in (lhs, rhs, g))
    grouped = jax.lax.ragged_dot(lhs32, rhs32, sizes, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(bench.forward_references(lhs, rhs, sizes)["grouped"], grouped,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bench.weight_gradient_reference(lhs, g, sizes),
                               bench._xla_weight_gradient(lhs32, g32, sizes, 4),
                               rtol=1e-5, atol=1e-5)

  def test_references_need_no_temporary_of_every_groups_rows(self):
    """XLA's float32 `ragged_dot` compiles to a temporary the size of a
    (G, M, K) array (75 GiB at deepseek-v2@4096 on the GPU, where the
    benchmark stopped on an H100); the references stay below one."""
    groups, m, k, n = 16, 512, 256, 128
    lhs = testing.random_array(9, (m, k), jnp.bfloat16)
    rhs = testing.random_array(10, (groups, k, n), jnp.bfloat16)
    g = testing.random_array(11, (m, n), jnp.bfloat16)
    sizes = jnp.full((groups,), m // groups, jnp.int32)
    group_sized_bytes = groups * m * k * 4
    for name, reference, args in (
        ("forward", lambda a, b: bench.forward_references(a, b, sizes)["grouped"], (lhs, rhs)),
        ("weight gradient", lambda a, b: bench.weight_gradient_reference(a, b, sizes), (lhs, g))):
      with self.subTest(name):
        compiled = jax.jit(reference).lower(*args).compile()
        self.assertLess(compiled.memory_analysis().temp_size_in_bytes, group_sized_bytes)

  def test_ours_and_xlas_are_the_same_gradient(self):
    """What the weight_gradient pass times: the same (G, K, N) on both sides."""
    lhs = testing.random_array(0, (200, 128), jnp.bfloat16)
    g = testing.random_array(1, (200, 192), jnp.bfloat16)
    sizes = jnp.array([70, 0, 100, 30], jnp.int32)
    want = bench._xla_weight_gradient(lhs.astype(jnp.float32), g.astype(jnp.float32), sizes, 4)
    with base.with_blocks(2):
      got = self.run_kernel(jax.jit(bench._our_weight_gradient), lhs, g, sizes)
    self.assert_close(got, want, dtype=jnp.bfloat16)


if __name__ == "__main__":
  absltest.main()
