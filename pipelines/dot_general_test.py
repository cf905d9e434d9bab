"""`pipelines.dot_general` against `jax.lax.dot_general`, and inside a Flax model.

The calls it maps onto the kernel (leading dimensions folded into M, a
transposed weight, the output dtype) against a float32 reference; each reason
to hand a call to lax, which must log it once and give lax's result; and a
small `flax.nnx` MLP trained a few steps with it against the same model on
lax's `dot_general`.
"""

import importlib
import logging
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from flax import nnx
from jax import lax

from core import testing
from core.numerics import RELATIVE_TOLERANCE, relative_error
from pipelines import dot_general
from pipelines import matmul_test_base as base

# The package's name `dot_general` is the function; the module holds the
# reasons already logged.
dot_general_module = importlib.import_module("pipelines.dot_general")
LOGGER = "pipelines.dot_general"
K, N = 128, 192


def dense(lhs_ndim: int, *, transpose_rhs: bool = False):
  """nnx.Linear's dimension numbers: lhs's last dimension against rhs's first
  (a (K, N) weight) or last (an (N, K) weight)."""
  return (((lhs_ndim - 1,), (1 if transpose_rhs else 0,)), ((), ()))


def reference(lhs, rhs, dimension_numbers):
  """The float32 product of the same operands."""
  return lax.dot_general(lhs.astype(jnp.float32), rhs.astype(jnp.float32), dimension_numbers,
                         precision=lax.Precision.HIGHEST)


class DotGeneralTestCase(testing.KernelTestCase):

  def setUp(self):
    super().setUp()
    # Every test starts with no reason logged yet.
    self.enter_context(mock.patch.object(dot_general_module, "_LOGGED_REASONS", set()))


class KernelCallTest(DotGeneralTestCase):

  def check(self, lhs, rhs, dimension_numbers, *, preferred_element_type=None, dtype):
    """Runs dot_general on the kernel (no fallback logged) and compares it
    with the float32 reference under `dtype`'s bounds."""
    with self.assertNoLogs(LOGGER, logging.WARNING):
      out = self.run_kernel(dot_general, lhs, rhs, dimension_numbers,
                            preferred_element_type=preferred_element_type)
    ref = reference(lhs, rhs, dimension_numbers)
    want_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    self.assertEqual((out.shape, out.dtype), (ref.shape, want_dtype))
    self.assert_close(out, ref, dtype=dtype)
    return out

  @parameterized.parameters(((64,), jnp.bfloat16), ((2, 32), jnp.float16),
                            ((2, 2, 16), jnp.bfloat16))
  def test_leading_dimensions_are_rows(self, leading, dtype):
    lhs = testing.random_array(1, (*leading, K), dtype)
    rhs = testing.random_array(2, (K, N), dtype)
    self.check(lhs, rhs, dense(lhs.ndim), dtype=dtype)

  def test_weight_stored_transposed(self):
    lhs = testing.random_array(3, (2, 32, K), jnp.bfloat16)
    rhs = testing.random_array(4, (N, K), jnp.bfloat16)
    self.check(lhs, rhs, dense(lhs.ndim, transpose_rhs=True), dtype=jnp.bfloat16)

  @parameterized.parameters(
      (jnp.float16, jnp.float32), (jnp.float16, jnp.bfloat16), (jnp.bfloat16, jnp.float32),
      (jnp.bfloat16, jnp.float16), (jnp.bfloat16, jnp.bfloat16))
  def test_out_dtype_from_preferred_element_type(self, operand_dtype, preferred_element_type):
    lhs = testing.random_array(5, (64, K), operand_dtype)
    rhs = testing.random_array(6, (K, N), operand_dtype)
    # The coarser of the operand and output dtypes bounds the error.
    coarser = jnp.bfloat16 if jnp.bfloat16 in (operand_dtype, preferred_element_type) else (
        jnp.float16)
    self.check(lhs, rhs, dense(2), preferred_element_type=preferred_element_type,
               dtype=coarser)

  # One-element tuples: a pair of precisions would be read as two arguments.
  @parameterized.parameters((lax.Precision.DEFAULT,), ("default",), ("fastest",),
                            (("bfloat16", lax.Precision.DEFAULT),),
                            (lax.DotAlgorithmPreset.DEFAULT,), ("DEFAULT",))
  def test_default_precision_in_any_form_is_the_kernel(self, precision):
    """lax's spellings of the default precision route to the kernel: nothing is
    logged when the call is traced (every fallback logs its reason)."""
    lhs = jax.ShapeDtypeStruct((64, K), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((K, N), jnp.bfloat16)
    with self.assertNoLogs(LOGGER, logging.WARNING):
      out = jax.eval_shape(lambda x, w: dot_general(x, w, dense(2), precision=precision),
                           lhs, rhs)
    self.assertEqual((out.shape, out.dtype), ((64, N), jnp.dtype(jnp.bfloat16)))

  @parameterized.parameters(False, True)
  def test_lowers_to_one_kernel_and_no_xla_dot(self, transpose_rhs):
    lhs = testing.random_array(7, (2, 32, K), jnp.bfloat16)
    rhs = testing.random_array(8, (N, K) if transpose_rhs else (K, N), jnp.bfloat16)
    dimension_numbers = dense(3, transpose_rhs=transpose_rhs)
    text = testing.lowered_for_gpu(lambda x, w: dot_general(x, w, dimension_numbers), lhs, rhs)
    self.assertEqual(testing.mosaic_kernel_count(text), 1)
    self.assertNotIn("stablehlo.dot_general", text)
    # The (N, K) weight is read as stored and the leading dimensions fold in place.
    self.assertNotIn("stablehlo.transpose", text)


def explicit_sharding():
  """A replicated sharding over a one-device mesh in explicit sharding mode."""
  mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
  return jax.sharding.NamedSharding(mesh, jax.P())


# Stands for `explicit_sharding()` in FALLBACKS, which is built when the test
# runs: making a mesh at import would start jax's backends.
EXPLICIT_SHARDING = "explicit_sharding()"
BF16_LHS = ((64, K), jnp.bfloat16)
BF16_RHS = ((K, N), jnp.bfloat16)
# (lhs (shape, dtype), rhs (shape, dtype), dimension_numbers, keyword arguments,
# what the log line says).
FALLBACKS = dict(
    float32_operands=(((64, K), jnp.float32), ((K, N), jnp.float32), dense(2), {},
                      "float32 operands"),
    mixed_dtypes=(BF16_LHS, ((K, N), jnp.float16), dense(2), {},
                  "mixed operand dtypes bfloat16 x float16"),
    batch_dimensions=(((2, 64, K), jnp.bfloat16), ((2, K, N), jnp.bfloat16),
                      (((2,), (1,)), ((0,), (0,))), {}, "batch dimensions (0,) x (0,)"),
    rhs_of_three_dimensions=(BF16_LHS, ((K, 2, 64), jnp.bfloat16), dense(2), {},
                             "rhs has 3 dimensions"),
    lhs_contracted_over_its_first_dimension=(((K, 64), jnp.bfloat16), BF16_RHS,
                                             (((0,), (0,)), ((), ())), {},
                                             "contracting dimensions (0,) x (0,)"),
    highest_precision=(BF16_LHS, BF16_RHS, dense(2), dict(precision=lax.Precision.HIGHEST),
                       "precision=Precision.HIGHEST"),
    # Without jax_enable_x64 lax itself truncates float64 to float32 (and warns).
    float64_output=(BF16_LHS, BF16_RHS, dense(2), dict(preferred_element_type=jnp.float64),
                    "preferred_element_type="),
    out_sharding=(BF16_LHS, BF16_RHS, dense(2), dict(out_sharding=EXPLICIT_SHARDING),
                  "out_sharding is set"),
)


class FallbackTest(DotGeneralTestCase):

  @parameterized.named_parameters(*((name, *case) for name, case in FALLBACKS.items()))
  def test_goes_to_lax_and_logs_why_once(self, lhs_spec, rhs_spec, dimension_numbers, kwargs,
                                         reason):
    lhs = testing.random_array(10, *lhs_spec)
    rhs = testing.random_array(11, *rhs_spec)
    if kwargs.get("out_sharding") == EXPLICIT_SHARDING:
      kwargs = dict(kwargs, out_sharding=explicit_sharding())
    with base.no_kernel_built(), self.assertLogs(LOGGER, logging.WARNING) as logs:
      out = dot_general(lhs, rhs, dimension_numbers, **kwargs)
    self.assertLen(logs.records, 1)
    self.assertIn(reason, logs.records[0].getMessage())
    np.testing.assert_array_equal(out, lax.dot_general(lhs, rhs, dimension_numbers, **kwargs))
    with base.no_kernel_built(), self.assertNoLogs(LOGGER, logging.WARNING):
      dot_general(lhs, rhs, dimension_numbers, **kwargs)

  def test_lax_raises_its_own_error(self):
    """A K mismatch is lax's to report, as it would be without this wrapper."""
    lhs = testing.random_array(12, (64, K), jnp.bfloat16)
    rhs = testing.random_array(13, (K + 64, N), jnp.bfloat16)
    with self.assertRaisesRegex(TypeError, "dot_general requires contracting dimensions"):
      dot_general(lhs, rhs, dense(2))

  def test_flax_default_float32_layer(self):
    """nnx.Linear's default param_dtype (float32) runs on lax, says why, and
    gives what the layer gives without `dot_general=`."""
    x = testing.random_array(14, (4, 16, K), jnp.float32)
    ours = nnx.Linear(K, N, dot_general=dot_general, rngs=nnx.Rngs(0))
    default = nnx.Linear(K, N, rngs=nnx.Rngs(0))
    with self.assertLogs(LOGGER, logging.WARNING) as logs:
      out = ours(x)
    self.assertIn("float32 operands", logs.records[0].getMessage())
    np.testing.assert_array_equal(out, default(x))


class MLP(nnx.Module):
  """128 -> 256 -> 128 with a gelu between, computed and stored in bfloat16."""

  def __init__(self, *, dot_general_fn, rngs: nnx.Rngs):
    layer = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, dot_general=dot_general_fn,
                 rngs=rngs)
    self.hidden = nnx.Linear(128, 256, **layer)
    self.out = nnx.Linear(256, 128, **layer)

  def __call__(self, x):
    return self.out(nnx.gelu(self.hidden(x)))


def mse(model: MLP, x, target):
  return jnp.mean((model(x).astype(jnp.float32) - target) ** 2)


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x, target):
  loss, grads = nnx.value_and_grad(mse)(model, x, target)
  optimizer.update(model, grads)
  return loss


STEPS = 4
LEARNING_RATE = 0.5
# Tolerances between the model on the kernel and the same model on lax. Both
# compute in bfloat16 with float32 accumulation; they differ only where a
# different accumulation order flips a bfloat16 rounding (one ulp, at most
# 2**-7 of the value), of an output, a cotangent, a gradient or a parameter.
# Losses: float32 means of squared errors of O(1): as if every output were
# rounded once more (half an ulp, 2**-9), a quadratic loss would move 2**-8.
LOSS_RTOL = 2**-8
# Parameters: each SGD step may flip the rounding of a parameter (one ulp of
# |p|) and of its update (one ulp of the update's size), so after STEPS steps
# |p_kernel - p_lax| <= STEPS * 2**-7 * (|p| + rms(p - p_initial)); and
# norm-wise within the bfloat16 tolerance of any kernel against a reference.
PARAM_RTOL = STEPS * 2**-7
PARAM_NORM_TOL = RELATIVE_TOLERANCE[jnp.dtype(jnp.bfloat16)]


class FlaxTrainingTest(DotGeneralTestCase):

  def data(self):
    # Random inputs and targets of unit scale: the loss starts at O(1). On
    # CPU these seeds give roundings that differ between the two models
    # (others train bit for bit alike there), so the bounds below are used.
    return (testing.random_array(0, (64, 128), jnp.float32),
            testing.random_array(1, (64, 128), jnp.float32))

  def test_training_step_runs_every_product_on_the_kernel(self):
    """Forward (2 products) and backward (d kernel of both layers, d input of
    the second; the first layer's d input is not needed) are Mosaic GPU
    kernels, and no XLA dot is left."""
    x, target = self.data()
    for name, dot_general_fn, kernels in (("ours", dot_general, 5),
                                          ("lax", lax.dot_general, 0)):
      graphdef, params = nnx.split(MLP(dot_general_fn=dot_general_fn, rngs=nnx.Rngs(0)))

      def loss(params, graphdef=graphdef):
        return mse(nnx.merge(graphdef, params), x, target)

      text = testing.lowered_for_gpu(jax.value_and_grad(loss), params)
      with self.subTest(dot_general=name):
        self.assertEqual(testing.mosaic_kernel_count(text), kernels)
        self.assertEqual("stablehlo.dot_general" in text, kernels == 0)

  def test_trains_like_the_model_on_lax(self):
    x, target = self.data()
    initial, losses, params = {}, {}, {}
    for name, dot_general_fn in (("kernel", dot_general), ("lax", lax.dot_general)):
      # The same seed: the same initial parameters (dot_general plays no part in init).
      model = MLP(dot_general_fn=dot_general_fn, rngs=nnx.Rngs(0))
      initial[name] = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
      optimizer = nnx.Optimizer(model, optax.sgd(LEARNING_RATE), wrt=nnx.Param)
      # Not through `run_kernel`: the step updates the model in place, which
      # its abstract evaluation (for the GPU's poison) must not do.
      first_kernel = len(self.kernel_race_states) if self.backend == testing.INTERPRET else 0
      losses[name] = [float(train_step(model, optimizer, x, target)) for _ in range(STEPS)]
      params[name] = nnx.state(model, nnx.Param)
      if self.backend == testing.INTERPRET:
        racy = [state for state in self.kernel_race_states[first_kernel:] if state.races_found]
        self.assertFalse(racy, f"the race detector flagged {len(racy)} kernel(s)")
    jax.tree.map(np.testing.assert_array_equal, initial["kernel"], initial["lax"])
    self.assertLess(losses["kernel"][-1], losses["kernel"][0])
    np.testing.assert_allclose(losses["kernel"], losses["lax"], rtol=LOSS_RTOL)
    leaves = zip(jax.tree.leaves(params["kernel"]), jax.tree.leaves(params["lax"]),
                 jax.tree.leaves(initial["lax"]), strict=True)
    for index, (got, want, start) in enumerate(leaves):
      with self.subTest(parameter=index):
        self.assertEqual((got.shape, got.dtype), (want.shape, jnp.dtype(jnp.bfloat16)))
        got, want, start = (np.asarray(a, np.float64) for a in (got, want, start))
        self.assertLessEqual(relative_error(got, want), PARAM_NORM_TOL)
        update_rms = np.sqrt(np.mean((want - start) ** 2))
        bound = PARAM_RTOL * (np.abs(want) + update_rms)
        self.assertTrue(np.all(np.abs(got - want) <= bound),
                        f"worst excess {np.max(np.abs(got - want) - bound):.3g}")


if __name__ == "__main__":
  absltest.main()
