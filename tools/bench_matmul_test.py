"""What `bench_matmul` compares against, and how it prints its results (no GPU)."""

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
from absl.testing import absltest, flagsaver, parameterized

from core import testing
from pipelines import TuningConfig, default_config
from pipelines.matmul import choose_config
from pipelines.operands import MatmulProblem, OperandLayout
from tools import bench_matmul, report

LAYOUTS = {name: OperandLayout(transpose_lhs=name[0] == "T", transpose_rhs=name[1] == "T")
           for name in ("NN", "TN", "NT", "TT")}


class BaselineTest(parameterized.TestCase):

  @parameterized.named_parameters(*LAYOUTS.items())
  def test_baseline_is_one_dot_that_writes_the_operand_dtype(self, layout):
    """As `jnp.dot` runs: a float32 output would make cuBLAS write twice
    the bytes and XLA add a conversion pass, a slower baseline than a user has."""
    m, k, n = 16, 32, 48
    lhs = jnp.ones(layout.lhs_shape(m, k), jnp.bfloat16)
    rhs = jnp.ones(layout.rhs_shape(k, n), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(bench_matmul.xla_dot(layout))(lhs, rhs).jaxpr
    self.assertEqual([eqn.primitive.name for eqn in jaxpr.eqns], ["dot_general"])
    self.assertEqual(jaxpr.outvars[0].aval.dtype, jnp.bfloat16)
    self.assertEqual(jaxpr.outvars[0].aval.shape, (m, n))

  def test_baseline_takes_the_transposed_operands_as_stored(self):
    lhs = jax.random.normal(jax.random.key(0), (32, 16), jnp.float32)
    rhs = jax.random.normal(jax.random.key(1), (48, 32), jnp.float32)
    got = bench_matmul.xla_dot(LAYOUTS["TT"])(lhs, rhs)
    self.assertLess(float(jnp.max(jnp.abs(got - lhs.T @ rhs.T))), 1e-4)

  def test_backward_baseline_products_take_the_operand_dtype(self):
    """XLA's autodiff of the bf16 layer: every product of its forward and
    backward reads and writes bf16, as ours do (a float32 product would let
    its backward run on float32 cotangents)."""
    lhs, rhs = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 48), jnp.bfloat16)
    bias = jnp.ones((48,), jnp.float32)

    def step(a, b, c):
      out, vjp = jax.vjp(bench_matmul.xla_gelu_layer, a, b, c)
      return vjp(jnp.ones_like(out))

    self.assertEqual(testing.dot_dtypes(step, lhs, rhs, bias), [(jnp.bfloat16,) * 3] * 3)


EXTRA_CONFIG = "tile_m=64,tile_n=128,max_concurrent_steps=3"


class ConfigsTest(absltest.TestCase):

  @flagsaver.flagsaver(ws_config=[EXTRA_CONFIG])
  def test_each_warp_specialized_row_has_its_config(self):
    """A record names the config its kernel ran, so that a run can be read
    without the heuristic of its day."""
    problem = MatmulProblem(m=4100, k=1000, n=3000, dtype=jnp.dtype(jnp.bfloat16))
    configs = bench_matmul.warp_specialized_configs(problem, jnp.bfloat16)
    self.assertEqual(configs[bench_matmul.WARP_SPECIALIZED],
                     choose_config(problem, jnp.bfloat16))
    self.assertEqual(configs[f"ours: warp-specialized [{EXTRA_CONFIG}]"],
                     TuningConfig(tile_m=64, tile_n=128, max_concurrent_steps=3))

  @flagsaver.flagsaver(heuristic_variant=["max_concurrent_steps=5", "epi_tile_n=128"])
  def test_heuristic_variants_change_each_problems_own_config(self):
    """A variant row is the heuristic's config of its problem with the given
    fields; one that is no valid config of a problem (a 128-column epilogue
    tile on 64-column warpgroup tiles) is left out of that problem only."""
    wide = MatmulProblem(m=2048, k=5120, n=5120, dtype=jnp.dtype(jnp.bfloat16))
    narrow = MatmulProblem(m=256, k=2048, n=3072, dtype=jnp.dtype(jnp.bfloat16))
    for problem, has_wide_epilogue in ((wide, True), (narrow, False)):
      heuristic = default_config(problem, jnp.bfloat16)
      configs = bench_matmul.warp_specialized_configs(problem, jnp.bfloat16)
      self.assertEqual(configs[f"{bench_matmul.HEURISTIC} [max_concurrent_steps=5]"],
                       dataclasses.replace(heuristic, max_concurrent_steps=5))
      self.assertEqual(f"{bench_matmul.HEURISTIC} [epi_tile_n=128]" in configs,
                       has_wide_epilogue, problem)


class PrintTest(absltest.TestCase):

  def test_table_prints_lists_of_numbers_and_of_names(self):
    """A bench record holds each round's median (floats) and, in the models
    suite, the models a problem came from (strings)."""
    records = [{"shape": "8x16x32", "round_median_us": [10.5, 11.25], "models": ["A", "B"]}]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      report.print_table(records, ["shape", "round_median_us", "models"])
    self.assertIn("10.500,11.250", out.getvalue())
    self.assertIn("A,B", out.getvalue())


if __name__ == "__main__":
  absltest.main()
