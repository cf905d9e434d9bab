"""`gated_linear_unit` against a float32 reference: forward, gradients, transforms, errors.

Ragged shapes under small configs with several tiles per block (so a tile's
stores meet the previous tile's), both weight forms (separate and fused
(K, 2, N)), every activation, and the products the differentiated forward
keeps for the backward.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import simulator
from core import testing
from core.numerics import RELATIVE_TOLERANCE
from pipelines import (
  MatmulDimension,
  Schedule,
  TuningConfig,
  gated_linear_unit,
  kernel_call,
  operands,
)
from pipelines import matmul_test_base as base
from pipelines.epilogue import ACTIVATIONS, Epilogue
from pipelines.gated_linear_unit import default_config

simulator.reserve_intra_op_threads()

SMALL = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                     wg_dimension=MatmulDimension.M)
SMALL_SPLIT_N = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=3,
                             wg_dimension=MatmulDimension.N, rhs_tile_n=64)
RAGGED = (200, 192, 328)


def reference(x, w_gate, w_up, activation):
  """float32 `activation(x @ w_gate) * (x @ w_up)`, weights stored (K, N)."""
  x, w_gate, w_up = (a.astype(jnp.float32) for a in (x, w_gate, w_up))
  hp = jax.lax.Precision.HIGHEST
  gate = jnp.dot(x, w_gate, precision=hp)
  return Epilogue(activation=activation).apply(gate) * jnp.dot(x, w_up, precision=hp)


def weights(seed, k, n, dtype=jnp.bfloat16):
  """Separate gate and up weights (K, N), scaled so the products are O(1)."""
  scale = 1.0 / np.sqrt(k)
  return (testing.random_array(seed, (k, n), dtype, scale=scale),
          testing.random_array(seed + 1, (k, n), dtype, scale=scale))


class GatedLinearUnitTest(testing.KernelTestCase):

  def check_forward(self, shape, *, activation="silu", fused=False, transpose_rhs=False,
                    config=SMALL, out_dtype=None, dtype=jnp.bfloat16, seed=0, blocks=2):
    m, k, n = shape
    x = testing.random_array(seed, (m, k), dtype)
    w_gate, w_up = weights(seed + 1, k, n, dtype)
    if fused:
      args = (jnp.stack([w_gate, w_up], axis=1),)
    elif transpose_rhs:
      args = (w_gate.T, w_up.T)
    else:
      args = (w_gate, w_up)
    fn = functools.partial(gated_linear_unit, activation=activation, config=config,
                           out_dtype=out_dtype, transpose_rhs=transpose_rhs)
    with base.with_blocks(blocks):
      out = self.run_kernel(fn, x, *args)
    self.assertEqual((out.shape, out.dtype), ((m, n), jnp.dtype(out_dtype or dtype)))
    self.assert_output_close(out, reference(x, w_gate, w_up, activation), operand_dtype=dtype)

  @parameterized.product(activation=ACTIVATIONS, fused=[False, True])
  def test_every_activation_and_weight_form_on_ragged_shapes(self, activation, fused):
    self.check_forward(RAGGED, activation=activation, fused=fused)

  @parameterized.named_parameters(
      ("warpgroups_split_n", dict(config=SMALL_SPLIT_N)),
      ("transposed_weights", dict(transpose_rhs=True)),
      ("float32_out", dict(out_dtype=jnp.float32)),
      ("float16", dict(dtype=jnp.float16, activation="gelu")),
      ("fused_n_off_16_bytes", dict(fused=True, shape=(136, 128, 100))),
      ("one_row", dict(shape=(1, 256, 192), fused=True)),
      # 12 tiles on 2 blocks, each block's on one ring of slots: 4 K steps
      # through 2 slots.
      ("chained_tiles", dict(config=dataclasses.replace(SMALL, chain_tiles=True),
                             shape=(200, 256, 328))),
      ("default_config_clustered", dict(config=None, shape=(256, 192, 384), blocks=4)),
      # 68 column tiles: more than 66 pairs of SMs, so not clustered.
      ("default_config_one_row", dict(config=None, shape=(1, 64, 8704), blocks=2)),
      # K of more than 3 K steps: the default's 4 stages did not fit a float32 output.
      ("default_config_float32_out", dict(config=None, shape=(64, 256, 128),
                                          out_dtype=jnp.float32, fused=True)),
  )
  def test_configs_layouts_and_dtypes(self, overrides):
    overrides = dict(overrides)
    self.check_forward(overrides.pop("shape", RAGGED), **overrides)

  def test_leading_dimensions_are_rows(self):
    x = testing.random_array(3, (2, 3, 40, 128), jnp.bfloat16)
    w_gate, w_up = weights(4, 128, 192)
    out = self.run_kernel(functools.partial(gated_linear_unit, config=SMALL), x, w_gate, w_up)
    self.assertEqual(out.shape, (2, 3, 40, 192))
    self.assert_close(out, reference(x, w_gate, w_up, "silu"), dtype=jnp.bfloat16)

  def test_empty_problems_launch_no_kernel(self):
    for m, k, n in ((0, 64, 64), (64, 0, 64), (64, 64, 0)):
      x = jnp.ones((m, k), jnp.bfloat16)
      w = jnp.ones((k, n), jnp.bfloat16)
      with self.subTest(shape=(m, k, n)), base.no_kernel_built():
        out = gated_linear_unit(x, w, w, config=SMALL)
        np.testing.assert_array_equal(out, np.zeros((m, n)))

  def check_grads(self, shape, *, activation="silu", fused=False, transpose_rhs=False, seed=10,
                  config=SMALL, dtype=jnp.bfloat16, blocks=2):
    """Gradients with a cotangent of x's dtype against the float32 reference,
    and at least as accurate as XLA's autodiff of the same 16-bit model: the
    kept products are 16-bit, as that model's are, so the strict element-wise
    bound (one rounding) does not apply to gradients; XLA's own error does."""
    m, k, n = shape
    x = testing.random_array(seed, (m, k), dtype)
    w_gate, w_up = weights(seed + 1, k, n, dtype)
    cotangent = testing.random_array(seed + 3, (m, n), dtype)

    def grads_of(fn, *args):
      out, vjp = jax.vjp(fn, *args)
      return vjp(cotangent.astype(out.dtype))

    glu = functools.partial(gated_linear_unit, activation=activation, config=config,
                            transpose_rhs=transpose_rhs)
    if fused:
      ws = (jnp.stack([w_gate, w_up], axis=1),)
    else:
      ws = (w_gate.T, w_up.T) if transpose_rhs else (w_gate, w_up)
    with base.with_blocks(blocks):
      grads = self.run_kernel(jax.jit(functools.partial(grads_of, glu)), x, *ws)
    for primal, grad in zip((x, *ws), grads, strict=True):
      self.assertEqual((grad.shape, grad.dtype), (primal.shape, primal.dtype))
    if fused:
      grads = (grads[0], grads[1][:, 0], grads[1][:, 1])
    elif transpose_rhs:
      grads = (grads[0], grads[1].T, grads[2].T)
    act = Epilogue(activation=activation).apply
    xla = grads_of(lambda x, g, u: act(x @ g) * (x @ u), x, w_gate, w_up)
    want = grads_of(functools.partial(reference, activation=activation),
                    *(a.astype(jnp.float32) for a in (x, w_gate, w_up)))
    for name, got, xla_got, ref in zip(("x", "w_gate", "w_up"), grads, xla, want, strict=True):
      with self.subTest(cotangent=name):
        self.assert_close(got, ref, dtype=dtype, tolerance=RELATIVE_TOLERANCE[jnp.dtype(dtype)])
        self.assert_as_accurate_as(got, xla_got, ref, dtype=dtype)

  @parameterized.product(activation=("silu", "gelu"), fused=[False, True])
  def test_gradients(self, activation, fused):
    self.check_grads(RAGGED, activation=activation, fused=fused)

  def test_gradients_of_transposed_weights(self):
    self.check_grads(RAGGED, activation="gelu", transpose_rhs=True)

  @parameterized.parameters(range(6))
  def test_random_problems(self, seed):
    """Drawn problems (`testing.random_size`) on the default config, as users
    call `gated_linear_unit`: M, K and N up to 300, each activation and
    dtype, fused, separate or transposed weights, a float32 output or not,
    and in some draws the grid capped at 2-4 blocks; the gradients of every
    third."""
    rng = np.random.default_rng(300 + seed)
    shape = tuple(testing.random_size(rng, 300) for _ in range(3))
    weight_form = rng.integers(3)
    options = dict(activation=ACTIVATIONS[rng.integers(len(ACTIVATIONS))],
                   fused=weight_form == 1, transpose_rhs=weight_form == 2, config=None,
                   dtype=(jnp.float16, jnp.bfloat16)[rng.integers(2)], seed=seed,
                   blocks=(None, None, 2, 3, 4)[rng.integers(5)])
    if seed % 3 == 2:
      self.check_grads(shape, **options)
    else:
      self.check_forward(shape, out_dtype=(None, jnp.float32)[rng.integers(2)], **options)

  def test_only_a_differentiated_forward_keeps_the_products(self):
    """One output without `jax.grad`; the two products beside it under it, and
    the backward recomputes no product: for separate weights 2 + 2 backward
    matmuls, for the fused weight 1 + 1."""
    x = testing.random_array(20, (128, 64), jnp.bfloat16)
    w_gate, w_up = weights(21, 64, 192)
    fused = jnp.stack([w_gate, w_up], axis=1)
    forward = functools.partial(gated_linear_unit, config=SMALL)
    self.assertEqual(base.kernel_output_shapes(forward, x, w_gate, w_up), [[(128, 192)]])
    for ws, backward_kernels in (((w_gate, w_up), 4), ((fused,), 2)):
      with self.subTest(fused=len(ws) == 1):
        step = jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)),
                        argnums=tuple(range(1 + len(ws))))
        text = testing.lowered_for_gpu(step, x, *ws)
        self.assertEqual(testing.mosaic_kernel_count(text), 1 + backward_kernels)
        self.assertNotIn("stablehlo.transpose", text)
    # Traced kernels are cached by shape: a new one, so that this one traces.
    self.assertEqual(base.kernel_output_shapes(lambda *a: jax.vjp(forward, *a)[0], x[:64], fused),
                     [[(64, 192)] * 3])

  @parameterized.parameters(320, 328, 336, 100)
  def test_fused_weight_of_any_n_lowers_for_the_gpu(self, n):
    """A fused (K, 2, N) weight whose halves' rows are off 128 bytes (N = 328,
    336, 100) lowers, as halves copied apart; N = 320 is read in place. Once
    Mosaic GPU failed to infer the layouts of such in-place views."""
    x = jax.ShapeDtypeStruct((72, 128), jnp.bfloat16)  # Shapes no other test traces.
    w = jax.ShapeDtypeStruct((128, 2, n), jnp.bfloat16)
    text = testing.lowered_for_gpu(functools.partial(gated_linear_unit, config=SMALL), x, w)
    self.assertEqual(testing.mosaic_kernel_count(text), 1)

  def test_grad_of_grad(self):
    x = testing.random_array(22, (64, 64), jnp.bfloat16)
    w_gate, w_up = weights(23, 64, 64)

    def outer(glu, x, w_gate, w_up):
      def inner(x, w_gate, w_up):
        return jnp.sum(glu(x, w_gate, w_up).astype(jnp.float32) ** 2)
      return jnp.sum(jax.grad(inner, argnums=1)(x, w_gate, w_up).astype(jnp.float32))

    glu = functools.partial(gated_linear_unit, activation="gelu", out_dtype=jnp.float32,
                            config=SMALL)
    got = self.run_kernel(jax.grad(functools.partial(outer, glu), argnums=(0, 2)),
                          x, w_gate, w_up)
    want = jax.grad(functools.partial(outer, lambda *a: reference(*a, "gelu")), argnums=(0, 2))(
        *(a.astype(jnp.float32) for a in (x, w_gate, w_up)))
    for g, w in zip(got, want, strict=True):
      self.assert_close(g, w, dtype=jnp.bfloat16, tolerance=3e-2)

  def test_under_vmap_scan_and_checkpoint(self):
    xs = testing.random_array(24, (2, 64, 64), jnp.bfloat16)
    w_gate, w_up = weights(25, 64, 128)
    # A float32 output keeps float32 products, so the gradients meet the
    # strict bound: these cases test the transforms, not the precision.
    glu = functools.partial(gated_linear_unit, config=SMALL, out_dtype=jnp.float32)
    ref = functools.partial(reference, activation="silu")
    cases = {
        "vmap, shared weights": (jax.vmap(glu, (0, None, None)), jax.vmap(ref, (0, None, None))),
        "vmap, batched weights": (
            lambda x, g, u: jax.vmap(glu)(x, jnp.stack([g, g]), jnp.stack([u, u])),
            lambda x, g, u: jax.vmap(ref)(x, jnp.stack([g, g]), jnp.stack([u, u]))),
        "scan": (lambda x, g, u: jax.lax.scan(lambda c, xi: (c + glu(xi, g, u), None),
                                              jnp.zeros((64, 128)), x)[0],
                 lambda x, g, u: jax.lax.scan(lambda c, xi: (c + ref(xi, g, u), None),
                                              jnp.zeros((64, 128)), x)[0]),
        "checkpoint": (jax.checkpoint(jax.vmap(glu, (0, None, None))),
                       jax.vmap(ref, (0, None, None))),
    }
    for name, (fn, reference_fn) in cases.items():
      with self.subTest(name):
        if name == "checkpoint" and self.backend == testing.INTERPRET:
          self.skipTest("the GPU interpreter orders kernels with an ordered io_callback, which "
                        "jax.checkpoint cannot differentiate; this case runs on the GPU")
        loss = lambda f, *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)  # noqa: E731
        got = self.run_kernel(jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1))),
                              xs, w_gate, w_up)
        want = jax.grad(functools.partial(loss, reference_fn), argnums=(0, 1))(
            *(a.astype(jnp.float32) for a in (xs, w_gate, w_up)))
        for g, w in zip(got, want, strict=True):
          self.assert_close(g, w, dtype=jnp.bfloat16)

  def test_inside_shard_map(self):
    """Rows sharded over two devices (one where the job has one)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    spec = jax.sharding.PartitionSpec
    if self.backend == testing.INTERPRET:
      self.enter_context(simulator.collective_interpret_mode(wait_timeout_s=60))
    x = testing.random_array(26, (128, 64), jnp.bfloat16)
    w_gate, w_up = weights(27, 64, 64)
    run = jax.shard_map(functools.partial(gated_linear_unit, config=SMALL,
                                          out_dtype=jnp.float32), mesh=mesh,
                        in_specs=(spec("x", None), spec(), spec()), out_specs=spec("x", None))
    loss = lambda f, *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)  # noqa: E731
    got = self.run_kernel(jax.jit(jax.grad(functools.partial(loss, run), argnums=(0, 1))),
                          x, w_gate, w_up)
    want = jax.grad(functools.partial(loss, functools.partial(reference, activation="silu")),
                    argnums=(0, 1))(*(a.astype(jnp.float32) for a in (x, w_gate, w_up)))
    for g, w in zip(got, want, strict=True):
      self.assert_close(g, w, dtype=jnp.bfloat16)


class DefaultConfigTest(absltest.TestCase):

  def problem(self, m, k=4096, n=14336):
    return operands.check_operands(jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                                   jax.ShapeDtypeStruct((k, n), jnp.bfloat16),
                                   operands.OperandLayout())

  def test_clusters_where_they_take_no_more_waves(self):
    # 64 row tiles of 112 column tiles: pairs fill the SMs as well as single CTAs.
    self.assertEqual(default_config(self.problem(8192), jnp.bfloat16).cluster_m, 2)
    # One row tile (decode): its 112 tiles are one wave alone, two in pairs.
    self.assertEqual(default_config(self.problem(1), jnp.bfloat16).cluster_m, 1)
    self.assertEqual(dataclasses.replace(default_config(self.problem(1), jnp.bfloat16),
                                         cluster_m=2),
                     default_config(self.problem(8192), jnp.bfloat16))

  def test_fits_every_output_dtype(self):
    # A float32 output's staging tile leaves room for 3 of BASE_CONFIG's 4 stages.
    for out_dtype, steps in ((jnp.bfloat16, 4), (jnp.float16, 4), (jnp.float32, 3)):
      config = default_config(self.problem(64, k=256), out_dtype)
      self.assertEqual(config.max_concurrent_steps, steps)
      kernel_call.check_ws_config(config, self.problem(64, k=256), out_dtype, gated=True)


class ValidationTest(parameterized.TestCase):
  """Bad input fails before anything is traced, naming the argument."""

  @parameterized.named_parameters(
      ("x_one_dimensional", dict(x=(64,)), "x must be"),
      ("weights_differ", dict(w_up=(64, 96)), "one shape and dtype"),
      ("weights_dtypes_differ", dict(w_up_dtype=jnp.float16), "one shape and dtype"),
      ("k_differs", dict(x=(32, 48)), "K of lhs and rhs differ"),
      ("fused_not_k_2_n", dict(w_gate=(64, 3, 64), w_up=None), r"fused \(K, 2, N\)"),
      ("fused_transposed", dict(w_gate=(64, 2, 64), w_up=None, transpose_rhs=True),
       "transpose_rhs applies"),
      ("float32_operands", dict(dtype=jnp.float32), "is not supported"),
      ("activation", dict(activation="tanh"), "activation='tanh'"),
      ("out_dtype", dict(out_dtype=jnp.int8), "out_dtype"),
      ("pingpong", dict(config=TuningConfig(schedule=Schedule.PINGPONG)), "gated unit needs"),
      ("split_k", dict(config=TuningConfig(k_splits=2)), "gated unit needs"),
      ("not_a_config", dict(config="fast"), "config must be a TuningConfig"),
  )
  def test_raises(self, overrides, message):
    args = dict(x=(32, 64), w_gate=(64, 64), w_up=(64, 64), dtype=jnp.bfloat16,
                w_up_dtype=None)
    args.update(overrides)
    dtype, w_up_dtype = args.pop("dtype"), args.pop("w_up_dtype")
    shapes = {name: args.pop(name) for name in ("x", "w_gate", "w_up")}
    arrays = {name: None if shape is None else
              jnp.ones(shape, w_up_dtype if name == "w_up" and w_up_dtype else dtype)
              for name, shape in shapes.items()}
    with base.no_kernel_built(), self.assertRaisesRegex(ValueError, message):
      gated_linear_unit(arrays["x"], arrays["w_gate"], arrays["w_up"], **args)


if __name__ == "__main__":
  absltest.main()
