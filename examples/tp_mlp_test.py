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
  def test_xla_model_products_take_the_operand_dtype(self, block):
    """The XLA model's step is the model as a user writes it in bf16: every
    product of its forward and backward writes bf16, as ours do (float32
    products made its backward run on float32 cotangents)."""
    mesh = jax.make_mesh((1,), (tp_mlp.AXIS,), devices=jax.devices()[:1])
    step = tp_mlp.make_train_step(tp_mlp.XLA_BLOCKS[block], tp_mlp.PARAM_SPECS[block], mesh,
                                  learning_rate=0.1)
    problem = tp_mlp.random_problem(block, 1, tp_mlp.CPU_SHAPE, jnp.bfloat16, mesh)
    text = step.lower(*problem).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    # Two products, the second's two backward products and the first's weight
    # gradient (the step takes no gradient of x).
    self.assertLen(dots, 5)
    for line in dots:
      self.assertRegex(line.split("->")[-1], r"xbf16>", line)

  @parameterized.parameters(*tp_mlp.BLOCKS)
  def test_float16(self, block):
    self.check(4, block=block, dtype=jnp.float16)


if __name__ == "__main__":
  absltest.main()
