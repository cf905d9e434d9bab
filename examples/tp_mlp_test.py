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

  @parameterized.product(num_devices=[2, 8], implementation=["auto", "xla_ring", "naive"])
  def test_step_matches_the_xla_model(self, num_devices, implementation):
    row = self.check(num_devices, implementation=implementation)
    if jax.default_backend() == "cpu":
      expected = {"auto": "xla_ring / xla_ring", "xla_ring": "xla_ring / xla_ring",
                  "naive": "xla_all_gather / xla_reduce_scatter"}[implementation]
      self.assertEqual(row["implementation"], expected)

  def test_float16(self):
    self.check(4, dtype=jnp.float16)


if __name__ == "__main__":
  absltest.main()
