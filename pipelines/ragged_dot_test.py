"""`ragged_dot` against `jax.lax.ragged_dot` in float32: groups, layouts, gradients, errors.

Small configs with several work items per block, so a tile's stores meet the
previous tile's; group sizes that put group edges inside tiles, inside
epilogue sub-tiles and off the 8-row windows, empty groups, single rows,
rows past the groups, and one group holding every row; the weight gradient's
ragged-K kernel; and one training step of a top-k routed expert layer against
the same layer on XLA.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import simulator
from core import testing
from core.numerics import RELATIVE_TOLERANCE, relative_error
from pipelines import (
  MatmulDimension,
  Schedule,
  TuningConfig,
  heuristic,
  kernel_call,
  matmul,
  operands,
  ragged_dot,
)
from pipelines import matmul_test_base as base
from pipelines.epilogue import ACTIVATIONS, Epilogue
from pipelines.ragged_dot import default_config as grouped_default_config

simulator.reserve_intra_op_threads()

# Warpgroups split M (a 128-row CTA tile) or N (64 rows, two 64-column halves).
SPLIT_M = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                       wg_dimension=MatmulDimension.M)
SPLIT_N = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                       wg_dimension=MatmulDimension.N)
# Edges inside tiles and sub-tiles, off 8 rows, an empty group, a single row,
# and rows past the groups (300 - 293 = 7 rows of zeros).
UNEVEN = (37, 0, 130, 1, 125)


def reference(lhs, rhs, group_sizes, activation="none", transpose_rhs=False):
  """float32 `activation(jax.lax.ragged_dot(...))`, weights stored (G, K, N) or (G, N, K)."""
  lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  out = jax.lax.ragged_dot(lhs, rhs, jnp.asarray(group_sizes, jnp.int32),
                           precision=jax.lax.Precision.HIGHEST)
  return Epilogue(activation=activation).apply(out)


def operands_of(seed, m, k, n, g, dtype=jnp.bfloat16, transpose_rhs=False):
  lhs = testing.random_array(seed, (m, k), dtype)
  rhs = testing.random_array(seed + 1, (g, n, k) if transpose_rhs else (g, k, n), dtype,
                             scale=1.0 / np.sqrt(k))
  return lhs, rhs


class RaggedDotTest(testing.KernelTestCase):

  def check_forward(self, group_sizes, *, m=300, k=128, n=192, activation="none",
                    transpose_rhs=False, config=SPLIT_M, out_dtype=None, dtype=jnp.bfloat16,
                    seed=0, blocks=2):
    lhs, rhs = operands_of(seed, m, k, n, len(group_sizes), dtype, transpose_rhs)
    sizes = jnp.array(group_sizes, jnp.int32)
    fn = functools.partial(ragged_dot, activation=activation, transpose_rhs=transpose_rhs,
                           config=config, out_dtype=out_dtype)
    with base.with_blocks(blocks):
      out = self.run_kernel(jax.jit(fn), lhs, rhs, sizes)
    self.assertEqual((out.shape, out.dtype), ((m, n), jnp.dtype(out_dtype or dtype)))
    self.assert_output_close(out, reference(lhs, rhs, sizes, activation, transpose_rhs),
                             operand_dtype=dtype)
    return out

  @parameterized.product(config=[SPLIT_M, SPLIT_N], activation=ACTIVATIONS)
  def test_uneven_groups_under_both_warpgroup_splits(self, config, activation):
    self.check_forward(UNEVEN, config=config, activation=activation)

  @parameterized.named_parameters(
      ("one_group_holds_every_row", dict(group_sizes=(0, 300, 0))),
      ("single_row_groups", dict(group_sizes=(1,) * 6, m=8)),
      ("groups_on_tile_edges", dict(group_sizes=(128, 64, 0, 108))),
      # Tiles whose second warpgroup owns one row (row 64 of the window), and
      # one whose second warpgroup owns none.
      ("one_row_in_the_second_half", dict(group_sizes=(65, 64, 63, 1), m=200)),
      ("no_rows_in_groups", dict(group_sizes=(0, 0))),
      ("transposed_weights", dict(group_sizes=UNEVEN, transpose_rhs=True)),
      ("ragged_k_and_n", dict(group_sizes=(50, 90, 60), m=200, k=200, n=136)),
      ("float16_to_float32", dict(group_sizes=UNEVEN, dtype=jnp.float16,
                                  out_dtype=jnp.float32)),
      ("default_config", dict(group_sizes=UNEVEN, config=None)),
      # The dense heuristic's tile for decode-size M and N <= 64 has 32-column
      # epilogue tiles, narrower than the grouped kernel's edge stores.
      ("default_config_decode_size_narrow_n", dict(group_sizes=(10, 0, 20, 5), m=64, n=32,
                                                   config=None)),
      ("default_config_no_columns", dict(group_sizes=(10, 0, 20, 5), m=64, n=0, config=None)),
      # Each block's tiles on one ring of slots (2 K steps through 2), past
      # tiles that skip their K loop: an empty group's and the rows past the groups.
      ("chained_tiles", dict(group_sizes=UNEVEN, config=dataclasses.replace(
          SPLIT_M, chain_tiles=True))),
      # Edge sub-tiles 256 bytes wide go out in two 128-byte column chunks.
      ("wide_epilogue_tiles", dict(group_sizes=UNEVEN, n=256, config=dataclasses.replace(
          SPLIT_M, tile_n=128, epi_tile_n=128))),
  )
  def test_group_shapes_layouts_and_dtypes(self, overrides):
    self.check_forward(**overrides)

  def test_rows_past_the_groups_are_zeros(self):
    out = self.check_forward((10, 20), m=100)
    np.testing.assert_array_equal(np.asarray(out[30:], np.float32), 0)

  def test_one_group_is_the_matmul(self):
    lhs, rhs = operands_of(5, 200, 128, 192, 1)
    sizes = jnp.array([200], jnp.int32)
    with base.with_blocks(2):
      got = self.run_kernel(jax.jit(functools.partial(ragged_dot, config=SPLIT_M)), lhs, rhs,
                            sizes)
      want = self.run_kernel(jax.jit(functools.partial(matmul, config=SPLIT_M)), lhs, rhs[0])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

  def test_a_new_routing_compiles_nothing(self):
    lhs, rhs = operands_of(6, 128, 64, 64, 3)
    traces = []

    @jax.jit
    def fn(lhs, rhs, sizes):
      traces.append(None)
      return ragged_dot(lhs, rhs, sizes, config=SPLIT_M)

    with base.with_blocks(2):
      # In interpret mode the first kernel run changes the tracing context,
      # so the second call traces once more (dense matmuls too); then
      # nothing retraces.
      for sizes in ((64, 64, 0), (0, 64, 64)):
        self.run_kernel(fn, lhs, rhs, jnp.array(sizes, jnp.int32))
      traced = len(traces)
      for sizes in ((128, 0, 0), (1, 2, 125), (40, 40, 40)):
        sizes = jnp.array(sizes, jnp.int32)
        out = self.run_kernel(fn, lhs, rhs, sizes)
        self.assert_close(out, reference(lhs, rhs, sizes), dtype=jnp.bfloat16)
    self.assertLen(traces, traced)

  def check_grads(self, group_sizes, *, m=300, k=128, n=192, activation="none",
                  transpose_rhs=False, config=SPLIT_M, dtype=jnp.bfloat16, seed=20, blocks=2):
    """Both cotangents, with a cotangent of the output's dtype, against the
    float32 reference; where a derivative is kept, no less accurate than
    XLA's autodiff of the same 16-bit model."""
    lhs, rhs = operands_of(seed, m, k, n, len(group_sizes), dtype, transpose_rhs)
    sizes = jnp.array(group_sizes, jnp.int32)
    cotangent = testing.random_array(seed + 3, (m, n), dtype)

    def grads_of(fn, lhs, rhs):
      out, vjp = jax.vjp(fn, lhs, rhs)
      return vjp(cotangent.astype(out.dtype))

    ours = functools.partial(ragged_dot, group_sizes=sizes, activation=activation,
                             transpose_rhs=transpose_rhs, config=config)
    with base.with_blocks(blocks):
      got = self.run_kernel(jax.jit(functools.partial(
          grads_of, lambda a, b: ours(a, b))), lhs, rhs)
    want = grads_of(lambda a, b: reference(a, b, sizes, activation, transpose_rhs),
                    lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    # XLA's autodiff of the same 16-bit model.
    xla = grads_of(lambda a, b: Epilogue(activation=activation).apply(jax.lax.ragged_dot(
        a, jnp.swapaxes(b, 1, 2) if transpose_rhs else b, sizes)), lhs, rhs)
    for name, g, w, xla_g, primal in zip(("lhs", "rhs"), got, want, xla, (lhs, rhs),
                                         strict=True):
      with self.subTest(cotangent=name):
        self.assertEqual((g.shape, g.dtype), (primal.shape, primal.dtype))
        # The cotangent enters the products in the operand dtype (as a
        # 16-bit model's does).
        if not Epilogue(activation=activation).keeps_derivative:
          self.assert_close(g, w, dtype=dtype)
          continue
        # A kept derivative is one more rounding before the cotangent's own,
        # so the strict element-wise bound (one rounding) does not apply, as
        # for the gated unit's kept products; XLA's own error does.
        self.assert_close(g, w, dtype=dtype, tolerance=RELATIVE_TOLERANCE[jnp.dtype(dtype)])
        self.assert_as_accurate_as(g, xla_g, w, dtype=dtype)
    # Rows past the groups get no gradient.
    np.testing.assert_array_equal(np.asarray(got[0][sum(group_sizes):], np.float32), 0)

  @parameterized.named_parameters(
      ("linear", dict()),
      ("gelu", dict(activation="gelu")),
      ("relu_transposed", dict(activation="relu", transpose_rhs=True)),
  )
  def test_gradients(self, overrides):
    self.check_grads(UNEVEN, **overrides)

  @parameterized.parameters(range(6))
  def test_random_problems(self, seed):
    """Drawn problems (`testing.random_size`) on the default config, as users
    call `ragged_dot`: M, K and N up to 300, 1-8 groups of random sizes
    (some empty, their sum M or less), weights of either layout, each dtype
    and activation, a float32 output or not, and in some draws the grid
    capped at 2-4 blocks; the gradients of every third."""
    rng = np.random.default_rng(200 + seed)
    m, k, n = (testing.random_size(rng, 300) for _ in range(3))
    num_groups = int(rng.integers(1, 9))
    # Cuts at random rows, so groups may be empty; the last group ends at M
    # or short of it.
    cuts = np.sort(rng.integers(0, m + 1, num_groups))
    cuts[-1] = (m, cuts[-1])[rng.integers(2)]
    group_sizes = tuple(int(size) for size in np.diff(cuts, prepend=0))
    options = dict(m=m, k=k, n=n, activation=ACTIVATIONS[rng.integers(len(ACTIVATIONS))],
                   transpose_rhs=bool(rng.integers(2)), config=None,
                   dtype=(jnp.float16, jnp.bfloat16)[rng.integers(2)], seed=seed,
                   blocks=(None, None, 2, 3, 4)[rng.integers(5)])
    if seed % 3 == 2:
      self.check_grads(group_sizes, **options)
    else:
      self.check_forward(group_sizes, out_dtype=(None, jnp.float32)[rng.integers(2)], **options)

  def test_gradients_run_no_xla_grouped_matmul(self):
    lhs, rhs = operands_of(21, 300, 128, 192, len(UNEVEN))
    sizes = jnp.array(UNEVEN, jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda a, b: ragged_dot(a, b, sizes, config=SPLIT_M).astype(
        jnp.float32).sum(), argnums=(0, 1)))(lhs, rhs)
    self.assertNotIn("ragged_dot", str(jaxpr))

  def test_lowers_for_the_gpu(self):
    """One Mosaic GPU kernel, under both splits."""
    lhs, rhs = operands_of(7, 300, 128, 192, len(UNEVEN))
    sizes = jnp.array(UNEVEN, jnp.int32)
    for config in (SPLIT_M, SPLIT_N):
      with self.subTest(config=config.wg_dimension):
        text = testing.lowered_for_gpu(
            functools.partial(ragged_dot, config=config, activation="silu"), lhs, rhs, sizes)
        self.assertEqual(testing.mosaic_kernel_count(text), 1)

  def test_bad_inputs_name_the_argument(self):
    lhs, rhs = operands_of(8, 64, 64, 64, 2)
    cases = [
        ((lhs[0], rhs, jnp.array([1, 2])), r"lhs must be 2-D \(M, K\)"),
        ((lhs, rhs[0], jnp.array([1, 2])), r"rhs must be 3-D \(\(G, K, N\)\)"),
        ((lhs, rhs, jnp.array([1, 2, 3])), r"group_sizes must have shape \(G,\)=\(2,\)"),
        ((lhs, rhs, jnp.array([1.0, 2.0])), r"group_sizes must be an integer array"),
        ((lhs, rhs, jnp.array([60, 5])), r"group_sizes sum to 65, more than the M=64 rows"),
        ((lhs, rhs, jnp.array([-1, 5])), r"group_sizes must not be negative"),
        ((lhs, rhs.astype(jnp.float16), jnp.array([1, 2])), r"dtype"),
        ((lhs, rhs[:, :32], jnp.array([1, 2])), r"K"),
    ]
    for args, message in cases:
      with self.subTest(message=message), base.no_kernel_built():
        with self.assertRaisesRegex(ValueError, message):
          ragged_dot(*args)
    with self.assertRaisesRegex(ValueError, r"cluster_m=1"):
      ragged_dot(lhs, rhs, jnp.array([1, 2]),
                 config=TuningConfig(tile_m=64, tile_n=64, cluster_m=2))
    # 64-byte rows of edge sub-tiles would start TMA copies off 128 bytes.
    with self.assertRaisesRegex(ValueError, r"epi_tile_n=32 of bfloat16 is 64 bytes"):
      ragged_dot(lhs, rhs, jnp.array([1, 2]), config=dataclasses.replace(SPLIT_M, epi_tile_n=32))

  def test_grad_of_grad_is_refused_by_name(self):
    lhs, rhs = operands_of(8, 64, 64, 64, 2)
    sizes = jnp.array([30, 34], jnp.int32)
    for activation in ("none", "gelu"):
      def inner(a, activation=activation):
        return jnp.sum(ragged_dot(a, rhs, sizes, activation=activation).astype(jnp.float32) ** 2)
      with self.assertRaisesRegex(TypeError, "ragged_dot is differentiable once"):
        jax.eval_shape(jax.grad(lambda a: jnp.sum(jax.grad(inner)(a).astype(jnp.float32))), lhs)

  def test_default_config_keeps_the_dense_pipeline_depth(self):
    """The grouped epilogue's staging for a group's edge rows leaves a 128x256
    tile the pipeline stages of the dense matmul's config (two stages ran
    Mixtral's experts at 0.81x dense, three at 0.96x)."""
    problem = operands.check_operands(jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16),
                                      jax.ShapeDtypeStruct((4096, 14336), jnp.bfloat16),
                                      operands.NN)
    dense = heuristic.default_config(problem, jnp.bfloat16, cooperative_only=True)
    grouped = grouped_default_config(problem, jnp.bfloat16)
    self.assertEqual((grouped.cta_tile_m, grouped.cta_tile_n), (dense.cta_tile_m, dense.cta_tile_n))
    self.assertEqual(grouped.max_concurrent_steps, dense.max_concurrent_steps)

  def test_default_config_counts_no_waves_of_the_dense_problem(self):
    """The dense heuristic gives a one-wave grid of 64x128 tiles 4 stages
    (Mixtral's experts at 32 tokens: 112 tiles); the grouped kernel runs a
    work item per expert and tile (896 here), so it keeps the depth of a
    grid of several waves."""
    problem = operands.check_operands(jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16),
                                      jax.ShapeDtypeStruct((4096, 14336), jnp.bfloat16),
                                      operands.NN)
    dense = heuristic.default_config(problem, jnp.bfloat16, cooperative_only=True)
    grouped = grouped_default_config(problem, jnp.bfloat16)
    self.assertEqual((dense.cta_tile_m, dense.cta_tile_n, dense.max_concurrent_steps), (64, 128, 4))
    self.assertEqual((grouped.cta_tile_m, grouped.cta_tile_n, grouped.max_concurrent_steps),
                     (64, 128, 6))

  @parameterized.product(m=[1, 64, 65, 4096], n=[8, 16, 32, 64, 100],
                         out_dtype=[jnp.bfloat16, jnp.float32])
  def test_default_config_runs_on_the_grouped_kernel(self, m, n, out_dtype):
    problem = operands.check_operands(jax.ShapeDtypeStruct((m, 2048), jnp.bfloat16),
                                      jax.ShapeDtypeStruct((2048, n), jnp.bfloat16),
                                      operands.NN)
    config = grouped_default_config(problem, out_dtype)
    kernel_call.check_ws_config(config, problem, out_dtype, grouped=True)

  def test_default_config_is_the_dense_cooperative_choice(self):
    """Where the dense heuristic takes ping-pong (many small experts, K =
    2048), the grouped kernel gets the heuristic's cooperative tile, not
    ping-pong's tile under the cooperative schedule (a 128x384 CTA tile with
    two stages, which computed 1536 columns of 1408)."""
    problem = operands.check_operands(jax.ShapeDtypeStruct((16384, 2048), jnp.bfloat16),
                                      jax.ShapeDtypeStruct((2048, 1408), jnp.bfloat16),
                                      operands.NN)
    self.assertEqual(heuristic.default_config(problem, jnp.bfloat16).schedule,
                     Schedule.PINGPONG)
    cooperative = heuristic.default_config(problem, jnp.bfloat16, cooperative_only=True)
    grouped = grouped_default_config(problem, jnp.bfloat16)
    self.assertEqual(grouped.schedule, Schedule.COOPERATIVE)
    self.assertEqual((grouped.tile_m, grouped.tile_n, grouped.wg_dimension),
                     (cooperative.tile_m, cooperative.tile_n, cooperative.wg_dimension))


def weight_gradient_reference(lhs, g, group_sizes):
  """float32 (G, K, N) of lhs[rows of group].T @ g[rows of group], group by group."""
  lhs, g = np.asarray(lhs, np.float32), np.asarray(g, np.float32)
  out, row = [], 0
  for size in np.asarray(group_sizes):
    size = max(0, min(int(size), lhs.shape[0] - row))
    out.append(lhs[row:row + size].T @ g[row:row + size])
    row += size
  return jnp.asarray(np.stack(out))


class RaggedKMatmulTest(testing.KernelTestCase):
  """`kernel_call.ws_ragged_k_matmul`, ragged_dot's weight gradient: a K loop
  per group over its rows, the other groups' rows zeroed at its ends."""

  @parameterized.named_parameters(
      ("uneven", dict(group_sizes=UNEVEN)),
      ("one_group_holds_every_row", dict(group_sizes=(0, 300, 0))),
      ("single_row_groups", dict(group_sizes=(1,) * 6, m=8)),
      ("groups_on_step_edges", dict(group_sizes=(128, 64, 0, 108))),
      ("groups_inside_one_step", dict(group_sizes=(3, 5, 9, 20, 2))),
      ("rows_past_the_groups", dict(group_sizes=(10, 20), m=100)),
      ("no_rows_in_groups", dict(group_sizes=(0, 0))),
      ("ragged_k_and_n", dict(group_sizes=(50, 90, 60), m=200, k=200, n=136)),
      ("float16_to_float32", dict(group_sizes=UNEVEN, dtype=jnp.float16,
                                  out_dtype=jnp.float32)),
      ("deeper_pipeline", dict(group_sizes=UNEVEN, steps=3)),
  )
  def test_against_each_groups_product(self, overrides):
    group_sizes = overrides.pop("group_sizes")
    m, k, n = overrides.pop("m", 300), overrides.pop("k", 128), overrides.pop("n", 192)
    dtype, out_dtype = overrides.pop("dtype", jnp.bfloat16), overrides.pop("out_dtype", None)
    config = dataclasses.replace(SPLIT_M, max_concurrent_steps=overrides.pop("steps", 2))
    assert not overrides, overrides
    lhs = testing.random_array(30, (m, k), dtype)
    g = testing.random_array(31, (m, n), dtype)
    sizes = jnp.array(group_sizes, jnp.int32)
    fn = functools.partial(kernel_call.ws_ragged_k_matmul, config=config, out_dtype=out_dtype)
    with base.with_blocks(2):
      out = self.run_kernel(jax.jit(fn), lhs, g, sizes)
    self.assertEqual((out.shape, out.dtype),
                     ((len(group_sizes), k, n), jnp.dtype(out_dtype or dtype)))
    # The operand dtype sets the bound, as for the dense matmul (`matmul_test_base`):
    # wgmma accumulates in float32 but not to float32 rounding.
    self.assert_close(out, weight_gradient_reference(lhs, g, sizes), dtype=dtype)

  def test_lowers_for_the_gpu(self):
    lhs = testing.random_array(32, (300, 128), jnp.bfloat16)
    g = testing.random_array(33, (300, 192), jnp.bfloat16)
    text = testing.lowered_for_gpu(
        functools.partial(kernel_call.ws_ragged_k_matmul, config=SPLIT_M), lhs, g,
        jnp.array(UNEVEN, jnp.int32))
    self.assertEqual(testing.mosaic_kernel_count(text), 1)

  def test_needs_the_warpgroups_to_split_m(self):
    lhs = testing.random_array(34, (64, 64), jnp.bfloat16)
    with base.no_kernel_built(), self.assertRaisesRegex(ValueError, r"wg_dimension"):
      kernel_call.ws_ragged_k_matmul(lhs, lhs, jnp.array([32, 32], jnp.int32), config=SPLIT_N)


def moe_layer(params, x, grouped_matmul, *, top_k=2):
  """A top-k routed expert layer: (T, D) tokens -> (T, D).

  The router picks `top_k` experts per token; the tokens' copies are sorted
  by expert, go through each expert's `gelu(x @ w_up) @ w_down` as two
  grouped matmuls (`grouped_matmul(rows, weights, group_sizes, activation)`),
  and are summed back per token, weighted by the softmax of their logits.
  """
  router, w_up, w_down = params
  num_experts = router.shape[1]
  logits, experts = jax.lax.top_k(x.astype(jnp.float32) @ router.astype(jnp.float32), top_k)
  gates = jax.nn.softmax(logits, axis=-1).reshape(-1)
  order = jnp.argsort(experts.reshape(-1), stable=True)
  token = order // top_k
  sizes = jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.int32)
  hidden = grouped_matmul(x[token], w_up, sizes, "gelu")
  out = grouped_matmul(hidden, w_down, sizes, "none").astype(jnp.float32)
  return jnp.zeros(x.shape, jnp.float32).at[token].add(out * gates[order][:, None])


class MoeLayerTrainingTest(testing.KernelTestCase):
  """One training step of a top-k routed expert layer on `ragged_dot`
  against the same layer on XLA's `jax.lax.ragged_dot`."""

  def test_one_step_like_the_xla_layer(self):
    tokens, dim, ffn, experts = 64, 64, 128, 4
    x = testing.random_array(40, (tokens, dim), jnp.bfloat16)
    target = testing.random_array(41, (tokens, dim), jnp.float32)
    params = (testing.random_array(42, (dim, experts), jnp.bfloat16),
              testing.random_array(43, (experts, dim, ffn), jnp.bfloat16, scale=dim ** -0.5),
              testing.random_array(44, (experts, ffn, dim), jnp.bfloat16, scale=ffn ** -0.5))

    def ours(rows, weights, sizes, activation):
      return ragged_dot(rows, weights, sizes, activation=activation, config=SPLIT_M)

    def xla(rows, weights, sizes, activation, dtype=jnp.bfloat16):
      out = jax.lax.ragged_dot(rows, weights, sizes, preferred_element_type=jnp.float32,
                               precision=jax.lax.Precision.HIGHEST)
      return Epilogue(activation=activation).apply(out).astype(dtype)

    def sgd_step(param, grad, learning_rate=0.1):
      return param.astype(jnp.float32) - learning_rate * grad.astype(jnp.float32)

    def loss(params, x, grouped_matmul):
      return jnp.mean((moe_layer(params, x, grouped_matmul) - target) ** 2)

    with base.with_blocks(2):
      got_loss, got = self.run_kernel(jax.jit(jax.value_and_grad(functools.partial(
          loss, grouped_matmul=ours))), params, x)
    xla_loss, xla_grads = jax.value_and_grad(functools.partial(loss, grouped_matmul=xla))(
        params, x)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (params, x))
    _, want = jax.value_and_grad(functools.partial(
        loss, grouped_matmul=functools.partial(xla, dtype=jnp.float32)))(*f32)
    # Both compute in bf16 with float32 accumulation: the losses differ by
    # roundings of the outputs (as in dot_general_test's training test).
    np.testing.assert_allclose(got_loss, xla_loss, rtol=2**-8)
    for name, g, xla_g, w, primal in zip(("router", "w_up", "w_down"), got, xla_grads, want,
                                         params, strict=True):
      with self.subTest(gradient=name):
        self.assertEqual((g.shape, g.dtype), (primal.shape, primal.dtype))
        self.assertLessEqual(relative_error(g, w), RELATIVE_TOLERANCE[jnp.dtype(jnp.bfloat16)])
        # No less accurate than the layer on XLA, up to one bf16 rounding: ours
        # rounds the cotangent to bf16 where it enters the products, the XLA
        # layer here (float32 ragged_dot outputs) transposes it in float32.
        self.assertLessEqual(relative_error(g, w), relative_error(xla_g, w) + 2**-8)
        # One SGD step moves the parameters as XLA's gradient would.
        self.assertLessEqual(relative_error(sgd_step(primal, g), sgd_step(primal, xla_g)),
                             2**-8)


if __name__ == "__main__":
  absltest.main()
