"""The tensor-parallel MLP step agrees with its XLA twin: every implementation on CPU devices."""

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized

# Importing jax starts no backend; the example asks for 8 simulated CPU devices
# before anything does (the Bazel target sets XLA_FLAGS too).
from examples import tp_mlp


class TpMlpTest(parameterized.TestCase):

  def check(self, num_devices, **kwargs):
    if num_devices > jax.device_count():
      self.skipTest(f"needs {num_devices} devices, the job has {jax.device_count()}")
    row = tp_mlp.run_row(num_devices, tp_mlp.CPU_SHAPE, iterations=1, **kwargs)
    for name, err in row["errors"].items():
      self.assertLessEqual(err, row["tolerance"], f"{name}: {row}")
    self.assertTrue(row["agree"])
    return row

  @parameterized.product(block=tp_mlp.BLOCKS, num_devices=[2, 8],
                         implementation=["auto", "xla_ring", "naive"])
  def test_step_matches_the_xla_model(self, block, num_devices, implementation):
    row = self.check(num_devices, block=block, implementation=implementation)
    if jax.default_backend() == "cpu":
      expected = {"auto": "xla_ring / xla_ring", "xla_ring": "xla_ring / xla_ring",
                  "naive": "xla_all_gather / xla_reduce_scatter"}[implementation]
      self.assertEqual(row["implementation"], expected)

  def test_one_device_gated_block_runs_the_gated_kernel(self):
    """Nothing to gather: the up projection is the fused gated kernel (in
    interpret mode on CPU)."""
    row = self.check(1, block="gated")
    self.assertTrue(row["implementation"].startswith("gated_linear_unit / "), row)

  @parameterized.parameters(*tp_mlp.BLOCKS)
  def test_float16(self, block):
    self.check(4, block=block, dtype=jnp.float16)


if __name__ == "__main__":
  absltest.main()
