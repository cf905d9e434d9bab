"""bench_ragged_dot's problems: routings that sum to M, layers from published configs."""

import numpy as np
from absl.testing import absltest, parameterized

from tools import bench_ragged_dot as bench


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

  def test_layers_cover_few_large_and_many_small_experts_and_decode(self):
    groups = {layer.groups for layer in bench.LAYERS}
    self.assertLessEqual(min(groups), 8)
    self.assertGreaterEqual(max(groups), 60)
    self.assertTrue(any(layer.m <= 256 for layer in bench.LAYERS))
    self.assertGreaterEqual(len(bench.LAYERS), 6)


if __name__ == "__main__":
  absltest.main()
