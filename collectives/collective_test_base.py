"""The cases every implementation of a collective matmul passes, written once.

`all_gather_matmul` and `matmul_reduce_scatter` each have several
implementations (the Mosaic ring kernel, the XLA ring, the naive XLA form);
each implementation's test is a short subclass of `CollectiveMatmulTestBase`
that names its function, its sharding layout and the shard shapes it can
tile. The global operands, the float32 reference, the tolerances, the
poisoning and the race check live here and in `core.testing`.
Test support only: no kernel module imports this.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl.testing import parameterized

from collectives import sharding
from core import testing
from pipelines import matmul_reference

DTYPES = (jnp.float16, jnp.bfloat16)


class CollectiveMatmulTestBase(testing.KernelTestCase):
  """Cases for one implementation of a collective matmul.

  Attributes:
    layout: `sharding.ALL_GATHER` (per device lhs (M_shard, K), rhs
      (K, N_shard)) or `sharding.REDUCE_SCATTER` (lhs (M, K_shard), rhs
      (K_shard, N)).
    shard: for the all-gather (M_shard, K, N_shard); for the reduce-scatter
      (M / D rows of one output block, K_shard, N).
    device_counts: ring sizes to run (a case needing more devices than the
      job has skips, saying so).
  """

  layout = sharding.ALL_GATHER
  shard = (64, 128, 32)
  device_counts = (2, 4, 8)

  def implementation(self, lhs_shard, rhs_shard, axis_name, *, dtype=None):
    """The implementation under test, called inside `shard_map` over `axis_name`."""
    raise NotImplementedError

  def global_operands(self, seed: int, d: int, dtype):
    """Random normal global operands of a ring of `d` devices."""
    a, k, b = self.shard
    if self.layout == sharding.ALL_GATHER:
      shapes = (d * a, k), (k, d * b)
    else:
      shapes = (d * a, d * k), (d * k, b)
    return (testing.random_array(seed, shapes[0], dtype),
            testing.random_array(seed + 1, shapes[1], dtype))

  def run_ring(self, d: int, lhs, rhs, **kwargs):
    if d > jax.device_count():
      self.skipTest(f"needs {d} devices, the job has {jax.device_count()}")
    mesh = sharding.ring_mesh(d)
    run = sharding.ring_matmul_fn(self.implementation, mesh, layout=self.layout, **kwargs)
    return self.run_kernel(run, *sharding.place_operands(lhs, rhs, mesh, self.layout))

  def check(self, d: int, dtype, *, seed: int, out_dtype=None):
    lhs, rhs = self.global_operands(seed, d, dtype)
    out = self.run_ring(d, lhs, rhs, dtype=out_dtype)
    expected_shape = (lhs.shape[0], rhs.shape[1])
    self.assertEqual((out.shape, out.dtype), (expected_shape, jnp.dtype(out_dtype or dtype)))
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=dtype)

  @parameterized.product(d_index=[0, 1, 2], dtype=DTYPES)
  def test_matches_reference(self, d_index, dtype):
    if d_index >= len(self.device_counts):
      self.skipTest(f"{type(self).__name__} runs rings of {self.device_counts} devices")
    self.check(self.device_counts[d_index], dtype, seed=20 + d_index)

  def test_output_dtype_other_than_the_operands(self):
    self.check(self.device_counts[0], jnp.bfloat16, seed=30, out_dtype=jnp.float16)
