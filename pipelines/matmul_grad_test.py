"""Gradients through `matmul`, against `jax.grad` of the float32 reference.

Every epilogue, output dtype and operand layout, on whole tiles and on ragged
shapes; that the backward products read the operands as stored (no transpose
in the lowered program); and that `matmul` composes with jit, vmap,
shard_map, checkpoint, scan and a second `jax.grad`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import simulator
from core import interpret, testing
from pipelines import (
  Epilogue,
  MatmulDimension,
  Schedule,
  TuningConfig,
  default_config,
  matmul,
  matmul_reference,
  pallas_call_matmul,
  pipelined_matmul,
  ws_matmul,
)
from pipelines import matmul_test_base as base
from pipelines import operands as ops

# XLA sizes its CPU thread pool when jax starts the CPU backend, which no
# import above does: size it for two simulated devices' kernels at once.
simulator.reserve_intra_op_threads()

ACTIVATIONS = ("none", "relu", "gelu", "silu")
SPLIT_K = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, k_splits=2)
PINGPONG = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                        schedule=Schedule.PINGPONG)


def loss_and_reference(*, activation, has_bias, out_dtype, layout, weights):
  """(loss through matmul, the same loss through the float32 reference): a
  weighted sum of the output, so every element gets a different cotangent."""
  epilogue = Epilogue(activation=activation, has_bias=has_bias)

  def loss(lhs, rhs, bias):
    out = matmul(lhs, rhs, bias, activation=activation, out_dtype=out_dtype,
                 transpose_lhs=layout.transpose_lhs, transpose_rhs=layout.transpose_rhs)
    return jnp.sum(out.astype(jnp.float32) * weights)

  def reference(lhs, rhs, bias):
    out = matmul_reference(lhs, rhs, bias, epilogue=epilogue, layout=layout)
    return jnp.sum(out * weights)

  return loss, reference


class MatmulGradTest(testing.KernelTestCase):

  def check_grads(self, shape, *, dtype=jnp.bfloat16, activation="gelu", has_bias=True,
                  out_dtype=jnp.float32, layout=base.NN, seed=40):
    m, k, n = shape
    lhs, rhs = base.operands(seed, m, k, n, dtype, layout)
    bias = testing.random_array(seed + 2, (n,), jnp.float32) if has_bias else None
    weights = testing.random_array(seed + 3, (m, n), jnp.float32)
    loss, reference = loss_and_reference(activation=activation, has_bias=has_bias,
                                         out_dtype=out_dtype, layout=layout, weights=weights)
    grads = self.run_kernel(jax.grad(loss, argnums=(0, 1, 2)), lhs, rhs, bias)
    f32 = [None if x is None else x.astype(jnp.float32) for x in (lhs, rhs, bias)]
    expected = jax.grad(reference, argnums=(0, 1, 2))(*f32)
    for name, got, want, primal in zip(("lhs", "rhs", "bias"), grads, expected, (lhs, rhs, bias),
                                       strict=True):
      if primal is None:
        self.assertIsNone(got)
        continue
      with self.subTest(cotangent=name):
        self.assertEqual((got.shape, got.dtype), (primal.shape, primal.dtype))
        # The cotangent enters the backward products in the operand dtype.
        self.assert_close(got, want, dtype=dtype)

  def test_transposed_decode_product(self):
    """16 rows, which the heuristic runs as the transposed product
    (`swap_operands`), as is d lhs (16 rows again); d rhs is not."""
    problem = ops.MatmulProblem(m=16, k=128, n=192, dtype=jnp.dtype(jnp.bfloat16))
    with testing.facts_of_the_fitted_gpu():
      self.assertTrue(default_config(problem, jnp.float32).swap_operands)
    self.check_grads((16, 128, 192))

  @parameterized.product(activation=ACTIVATIONS, layout_index=list(range(len(base.LAYOUTS))))
  def test_epilogues_and_layouts_on_ragged_shapes(self, activation, layout_index):
    self.check_grads((72, 80, 56), activation=activation, layout=base.LAYOUTS[layout_index])

  @parameterized.product(out_dtype=[jnp.float16, jnp.bfloat16, jnp.float32],
                         has_bias=[False, True])
  def test_output_dtypes_on_whole_tiles(self, out_dtype, has_bias):
    dtype = jnp.float16 if out_dtype == jnp.float16 else jnp.bfloat16
    self.check_grads((128, 128, 128), dtype=dtype, activation="relu", has_bias=has_bias,
                     out_dtype=out_dtype)

  @parameterized.parameters(range(4))
  def test_random_problems(self, seed):
    """Drawn problems (`testing.random_size`, up to 200 a side) on the
    heuristic's configs for the forward and both backward products: each
    layout, dtype and activation, a bias or none, each output dtype."""
    rng = np.random.default_rng(100 + seed)
    shape = tuple(testing.random_size(rng, 200) for _ in range(3))
    dtype = (jnp.float16, jnp.bfloat16)[rng.integers(2)]
    self.check_grads(shape, dtype=dtype, activation=ACTIVATIONS[rng.integers(len(ACTIVATIONS))],
                     has_bias=bool(rng.integers(2)),
                     out_dtype=(dtype, jnp.float32)[rng.integers(2)],
                     layout=base.LAYOUTS[rng.integers(len(base.LAYOUTS))], seed=seed)

  def test_backward_reads_operands_as_stored(self):
    """The lowered backward pass has matmul kernels and no transpose of an operand."""
    lhs, rhs = base.operands(41, 256, 128, 192, jnp.bfloat16)
    bias = testing.random_array(43, (192,), jnp.float32)
    weights = testing.random_array(44, (256, 192), jnp.float32)
    loss, _ = loss_and_reference(activation="silu", has_bias=True, out_dtype=jnp.float32,
                                 layout=base.NN, weights=weights)
    with interpret.interpret_disabled():
      text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(lhs, rhs, bias).lower(
          lowering_platforms=("cuda",)).as_text()
    # The forward product (which also writes the derivative), d lhs and
    # d rhs: no product is recomputed.
    self.assertEqual(text.count("stablehlo.custom_call @mosaic_gpu"), 3)
    self.assertNotIn("stablehlo.transpose", text)

  @parameterized.parameters(("gelu", "stablehlo.tanh"), ("silu", "stablehlo.exponential"))
  def test_backward_multiplies_by_the_kept_derivative(self, activation, activation_op):
    """Outside the kernels the backward evaluates no activation: the
    derivative comes from the forward's epilogue, so XLA is left one
    multiply, fused with d bias into one pass."""
    lhs, rhs = base.operands(58, 128, 64, 192, jnp.bfloat16)
    bias = testing.random_array(59, (192,), jnp.float32)
    weights = testing.random_array(60, (128, 192), jnp.float32)
    loss, _ = loss_and_reference(activation=activation, has_bias=True, out_dtype=jnp.bfloat16,
                                 layout=base.NN, weights=weights)
    text = testing.lowered_for_gpu(jax.grad(loss, argnums=(0, 1, 2)), lhs, rhs, bias)
    self.assertEqual(testing.mosaic_kernel_count(text), 3)
    self.assertNotIn(activation_op, text)

  @parameterized.parameters("gelu", "silu")
  def test_only_a_differentiated_forward_writes_the_derivative(self, activation):
    """The kernel writes a second (M, N) output under `jax.grad` and none without."""
    lhs, rhs = base.operands(42, 128, 64, 192, jnp.bfloat16)
    bias = testing.random_array(43, (192,), jnp.float32)

    def forward(a, b, c):
      return matmul(a, b, c, activation=activation)

    def forward_for_grad(a, b, c):
      out, _ = jax.vjp(forward, a, b, c)
      return out

    self.assertEqual(base.kernel_output_shapes(forward, lhs, rhs, bias), [[(128, 192)]])
    self.assertEqual(base.kernel_output_shapes(forward_for_grad, lhs, rhs, bias),
                     [[(128, 192), (128, 192)]])

  @parameterized.named_parameters(
      ("cooperative", dict(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)),
      ("cooperative_3_sub_tiles", dict(tile_m=64, tile_n=192, tile_k=64,
                                       max_concurrent_steps=2)),
      ("pingpong", dict(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                        schedule=Schedule.PINGPONG)),
      ("split_k", dict(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, k_splits=2)),
      ("transposed_product", dict(tile_m=64, tile_n=16, tile_k=64, epi_tile_n=16,
                                  max_concurrent_steps=2, wg_dimension=MatmulDimension.M,
                                  swap_operands=True)),
  )
  def test_kept_derivative_of_each_schedule(self, config_fields):
    """Both outputs of the epilogue, on ragged shapes with several tiles per
    block, so a tile's stores of two outputs meet the previous tile's."""
    m, k, n = 200, 192, 328
    lhs, rhs = base.operands(55, m, k, n, jnp.bfloat16)
    bias = testing.random_array(57, (n,), jnp.float32)
    epilogue = Epilogue(activation="gelu", has_bias=True)
    with base.with_blocks(2):
      out, derivative = self.run_kernel(functools.partial(
          ws_matmul, config=TuningConfig(**config_fields), epilogue=epilogue,
          keep_derivative=True), lhs, rhs, bias)
    f32 = (lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    self.assert_close(out, matmul_reference(*f32, bias, epilogue=epilogue), dtype=jnp.bfloat16)
    pre_activation = matmul_reference(*f32, bias, epilogue=Epilogue(has_bias=True))
    self.assertEqual(derivative.dtype, jnp.float16)  # Bits that bfloat16 lacks, in its bytes.
    self.assert_close(derivative, epilogue.derivative(pre_activation), dtype=jnp.float16)

  @parameterized.parameters("gelu", "silu")
  def test_grad_of_grad_through_the_kept_derivative(self, activation):
    lhs, rhs = base.operands(53, 64, 64, 64, jnp.bfloat16)
    bias = testing.random_array(54, (64,), jnp.float32)

    def outer(inner_matmul, a, b, c):
      def inner(a, b, c):
        return jnp.sum(inner_matmul(a, b, c).astype(jnp.float32) ** 2)
      return jnp.sum(jax.grad(inner, argnums=1)(a, b, c).astype(jnp.float32))

    mm = functools.partial(matmul, activation=activation, out_dtype=jnp.float32)
    ref = functools.partial(matmul_reference, epilogue=Epilogue(activation=activation,
                                                                has_bias=True))
    got = self.run_kernel(jax.grad(functools.partial(outer, mm), argnums=(0, 2)), lhs, rhs, bias)
    want = jax.grad(functools.partial(outer, ref), argnums=(0, 2))(
        lhs.astype(jnp.float32), rhs.astype(jnp.float32), bias)
    for g, w in zip(got, want, strict=True):
      self.assert_close(g, w, dtype=jnp.bfloat16, tolerance=3e-2)

  @parameterized.parameters("gelu", "silu")
  def test_grad_of_grad_of_a_16_bit_output_past_float16s_range(self, activation):
    """A bf16 output keeps a float16 derivative. A second differentiation
    whose cotangents pass float16's 65504 (a loss summed over many values,
    its gradient then squared) matches the reference, rather than turning
    the derivative's float16 cotangent into inf."""
    lhs, rhs = base.operands(56, 64, 64, 64, jnp.bfloat16)
    bias = testing.random_array(57, (64,), jnp.float32)

    def outer(inner_matmul, a, b, c):
      def inner(a, b, c):
        return 300.0 * jnp.sum(inner_matmul(a, b, c).astype(jnp.float32))
      return jnp.sum(jax.grad(inner)(a, b, c).astype(jnp.float32) ** 2)

    mm = functools.partial(matmul, activation=activation)
    ref = functools.partial(matmul_reference, epilogue=Epilogue(activation=activation,
                                                                has_bias=True))
    got = self.run_kernel(jax.grad(functools.partial(outer, mm), argnums=(0, 1, 2)),
                          lhs, rhs, bias)
    want = jax.grad(functools.partial(outer, ref), argnums=(0, 1, 2))(
        lhs.astype(jnp.float32), rhs.astype(jnp.float32), bias)
    self.assertGreater(float(jnp.max(jnp.abs(want[0]))), 65504)
    for g, w in zip(got, want, strict=True):
      self.assert_close(g, w, dtype=jnp.bfloat16, tolerance=3e-2)

  @parameterized.parameters(*ACTIVATIONS)
  def test_epilogue_derivatives_are_autodiffs_of_the_activation(self, activation):
    epilogue = Epilogue(activation=activation)
    x = testing.random_array(61, (4096,), jnp.float32, scale=3.0)
    value, derivative = epilogue.apply_and_derivative(x)
    np.testing.assert_allclose(value, epilogue.apply(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(derivative, jax.vmap(jax.grad(epilogue.apply))(x),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(epilogue.second_derivative(x),
                               jax.vmap(jax.grad(jax.grad(epilogue.apply)))(x),
                               rtol=1e-4, atol=1e-5)

  def test_jvp_raises_one_clear_error(self):
    lhs, rhs = base.operands(45, 64, 64, 64, jnp.bfloat16)
    with self.assertRaisesRegex(TypeError, "can't apply forward-mode autodiff"):
      jax.jvp(matmul, (lhs, rhs), (lhs, rhs))

  def test_grad_of_grad(self):
    """The backward pass is made of matmuls, so it is differentiable again."""
    lhs, rhs = base.operands(46, 64, 64, 64, jnp.bfloat16)

    def inner(a, b):
      return jnp.sum(matmul(a, b, out_dtype=jnp.float32) ** 2)

    def outer(a, b):
      return jnp.sum(jax.grad(inner)(a, b).astype(jnp.float32))

    def outer_reference(a, b):
      def inner_reference(a, b):
        return jnp.sum(matmul_reference(a, b) ** 2)
      return jnp.sum(jax.grad(inner_reference)(a, b))

    got = self.run_kernel(jax.grad(outer), lhs, rhs)
    want = jax.grad(outer_reference)(lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    self.assert_close(got, want, dtype=jnp.bfloat16, tolerance=3e-2)

  def test_under_jit_vmap_checkpoint_and_scan(self):
    """Batched lhs with a shared rhs, both batched, under checkpoint and inside scan."""
    lhs = testing.random_array(47, (2, 64, 64), jnp.bfloat16)
    rhs = testing.random_array(48, (64, 64), jnp.bfloat16)
    rhs_batch = testing.random_array(49, (2, 64, 64), jnp.bfloat16)
    mm = functools.partial(matmul, activation="relu", out_dtype=jnp.float32)
    ref = functools.partial(matmul_reference, epilogue=Epilogue(activation="relu"))
    f32 = functools.partial(jax.tree.map, lambda x: x.astype(jnp.float32))
    cases = {
        "vmap, shared rhs": (lambda a, b: jnp.sum(jax.vmap(mm, (0, None))(a, b) ** 2),
                             lambda a, b: jnp.sum(jax.vmap(ref, (0, None))(a, b) ** 2), rhs),
        "vmap, both batched": (lambda a, b: jnp.sum(jax.vmap(mm)(a, b) ** 2),
                               lambda a, b: jnp.sum(jax.vmap(ref)(a, b) ** 2), rhs_batch),
        "checkpoint": (lambda a, b: jnp.sum(jax.checkpoint(jax.vmap(mm, (0, None)))(a, b) ** 2),
                       lambda a, b: jnp.sum(jax.vmap(ref, (0, None))(a, b) ** 2), rhs),
        "scan": (lambda a, b: jnp.sum(jax.lax.scan(lambda c, x: (c + mm(x, b), None),
                                                   jnp.zeros((64, 64)), a)[0] ** 2),
                 lambda a, b: jnp.sum(jax.lax.scan(lambda c, x: (c + ref(x, b), None),
                                                   jnp.zeros((64, 64)), a)[0] ** 2), rhs),
    }
    for name, (loss, reference, b) in cases.items():
      with self.subTest(name):
        if name == "checkpoint" and self.backend == testing.INTERPRET:
          self.skipTest("the GPU interpreter orders kernels with an ordered io_callback, which "
                        "jax.checkpoint cannot differentiate; this case runs on the GPU")
        got = self.run_kernel(jax.jit(jax.grad(loss, argnums=(0, 1))), lhs, b)
        want = jax.grad(reference, argnums=(0, 1))(*f32((lhs, b)))
        for g, w in zip(got, want, strict=True):
          self.assert_close(g, w, dtype=jnp.bfloat16)

  def test_inside_shard_map(self):
    """Rows of the LHS sharded over two devices: each device's cotangent is its own. A
    kernel result typed as the same on every device made JAX sum the devices'
    cotangents (relative error 1.0). One device where the job has one."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    spec = jax.sharding.PartitionSpec
    if self.backend == testing.INTERPRET:
      # The plain interpreter runs one device's kernels at a time.
      self.enter_context(simulator.collective_interpret_mode(wait_timeout_s=60))
    lhs, rhs = base.operands(50, 128, 64, 64, jnp.bfloat16)
    weights = testing.random_array(52, (128, 64), jnp.float32)

    def loss(a, b):
      out = jax.shard_map(functools.partial(matmul, out_dtype=jnp.float32), mesh=mesh,
                          in_specs=(spec("x", None), spec()), out_specs=spec("x", None))(a, b)
      return jnp.sum(out * weights)

    got = self.run_kernel(jax.jit(jax.grad(loss, argnums=(0, 1))), lhs, rhs)
    want = jax.grad(lambda a, b: jnp.sum(matmul_reference(a, b) * weights), argnums=(0, 1))(
        lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    for g, w in zip(got, want, strict=True):
      self.assert_close(g, w, dtype=jnp.bfloat16)

  @parameterized.named_parameters(
      ("matmul", matmul),
      ("matmul_transposed", functools.partial(matmul, transpose_lhs=True, transpose_rhs=True)),
      ("ws_matmul_split_k", functools.partial(ws_matmul, config=SPLIT_K)),
      ("ws_matmul_pingpong", functools.partial(ws_matmul, config=PINGPONG)),
      ("pipelined_matmul", pipelined_matmul),
      ("pallas_call_matmul", pallas_call_matmul),
      ("empty_k", matmul, 0),
  )
  def test_results_vary_over_the_axes_of_their_operands(self, fn, k=128):
    """Inside shard_map every kernel result is typed as varying where an operand
    varies (`core.varying`), which is what makes the gradients above right."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    spec = jax.sharding.PartitionSpec
    seen = []

    def per_device(a, b):
      out = fn(a, b)
      seen.append(jax.typeof(out).manual_axis_type.varying)
      return out

    abstract = jax.ShapeDtypeStruct((128, k), jnp.float16)
    run = jax.shard_map(per_device, mesh=mesh, in_specs=(spec("x", None), spec()),
                        out_specs=spec("x", None))
    jax.eval_shape(run, abstract, abstract.update(shape=(k, 128)))
    self.assertEqual(seen, [frozenset({"x"})])

if __name__ == "__main__":
  absltest.main()
