"""The public `matmul`: the base cases on the heuristic's configs, jit/vmap/shard_map,
the heuristic itself, and bad input."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from core import interpret, testing
from pipelines import (
  Epilogue,
  Fp8Config,
  MatmulDimension,
  PipelinedConfig,
  Schedule,
  TuningConfig,
  default_config,
  kernel_call,
  matmul,
  matmul_reference,
  pallas_call_matmul,
  pipelined_matmul,
  ws_matmul,
)
from pipelines import matmul_test_base as base
from pipelines import operands as ops
from pipelines.config import operand_swizzle

SMALL_WS = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                        epi_tile_m=64, epi_tile_n=32, grid_tile_width=2)


class MatmulTest(base.MatmulTestBase):
  """The base cases through `matmul` itself, with the configs its heuristic picks."""

  tiled_by_config = False

  def run_matmul(self, lhs, rhs, bias=None, *, epilogue=Epilogue(), out_dtype=None,
                 layout=base.NN):
    return matmul(lhs, rhs, bias, activation=epilogue.activation, out_dtype=out_dtype,
                  transpose_lhs=layout.transpose_lhs, transpose_rhs=layout.transpose_rhs)

  @parameterized.product(layout_index=list(range(len(base.LAYOUTS))), k=[8, 24])
  def test_short_k_in_one_step(self, layout_index, k):
    """The heuristic's one short K step (16 or 32 elements for K = 8 or 24)
    in every operand layout but TN, on ragged M and N: the columns past K,
    which the TMA engine fills with zeros, add nothing. TN keeps 64-element
    steps, which its swizzle needs (a 16-element step failed to lower on an
    H200)."""
    layout = base.LAYOUTS[layout_index]
    problem = ops.MatmulProblem(m=200, k=k, n=136, dtype=jnp.dtype(jnp.bfloat16), layout=layout)
    tn = layout.transpose_lhs and not layout.transpose_rhs
    self.assertEqual(default_config(problem, jnp.bfloat16).tile_k < 64, not tn)
    # Mosaic GPU's wgmma checks run when the kernel is lowered for CUDA (on a
    # CPU too); the interpreter does not make them.
    lowered = testing.lowered_for_gpu(functools.partial(self.run_matmul, layout=layout),
                                      *base.operands(43, 200, k, 136, jnp.bfloat16, layout))
    self.assertEqual(testing.mosaic_kernel_count(lowered), 1)
    self.check((200, k, 136), jnp.bfloat16, seed=43, layout=layout,
               epilogue=Epilogue(activation="gelu", has_bias=True))


  @parameterized.parameters(range(10))
  def test_random_problems(self, seed):
    """Drawn problems (`testing.random_size`) on the heuristic's configs, as
    users call `matmul`: M, K and N up to 300, each layout and dtype, an
    activation, a bias or none, a float32 output or not, and in some draws
    the grid capped at 2-4 blocks, so blocks walk several tiles. The other
    cases pin the shapes they mean; these meet the heuristic's rules in
    combinations no case names."""
    rng = np.random.default_rng(seed)
    shape = tuple(testing.random_size(rng, 300) for _ in range(3))
    dtype = (jnp.float16, jnp.bfloat16)[rng.integers(2)]
    epilogue = Epilogue(activation=base.ACTIVATIONS[rng.integers(len(base.ACTIVATIONS))],
                        has_bias=bool(rng.integers(2)))
    self.check(shape, dtype, seed=seed, epilogue=epilogue,
               out_dtype=(None, jnp.float32)[rng.integers(2)],
               num_blocks=(None, None, 2, 3, 4)[rng.integers(5)],
               layout=base.LAYOUTS[rng.integers(len(base.LAYOUTS))])


class MatmulApiTest(testing.KernelTestCase):

  def test_jit_and_vmap(self):
    lhs = testing.random_array(10, (3, 64, 128), jnp.float16)
    rhs = testing.random_array(11, (128, 64), jnp.float16)
    run = jax.jit(jax.vmap(functools.partial(matmul, config=SMALL_WS), in_axes=(0, None)))
    out = self.run_kernel(run, lhs, rhs)
    self.assert_close(out, jnp.einsum("bmk,kn->bmn", lhs.astype(jnp.float32),
                                      rhs.astype(jnp.float32)), dtype=jnp.float16)
    rhs_batch = testing.random_array(12, (3, 128, 64), jnp.float16)
    out = self.run_kernel(jax.vmap(functools.partial(matmul, config=SMALL_WS)), lhs, rhs_batch)
    self.assert_close(out, jnp.einsum("bmk,bkn->bmn", lhs.astype(jnp.float32),
                                      rhs_batch.astype(jnp.float32)), dtype=jnp.float16)

  def test_transposed_decode_under_vmap(self):
    """The heuristic's transposed product for 16 rows (`swap_operands`) under
    vmap: 3 batches of 16 rows run as 48, in the config of 16, with a bias
    and gelu (its gradients: `matmul_grad_test`)."""
    lhs = testing.random_array(14, (3, 16, 128), jnp.bfloat16)
    rhs = testing.random_array(15, (128, 192), jnp.bfloat16)
    bias = testing.random_array(16, (192,), jnp.float32)
    problem = ops.MatmulProblem(m=16, k=128, n=192, dtype=jnp.dtype(jnp.bfloat16))
    with testing.facts_of_the_fitted_gpu():
      self.assertTrue(default_config(problem, jnp.bfloat16).swap_operands)
    layer = jax.vmap(functools.partial(matmul, activation="gelu"), in_axes=(0, None, None))
    out = self.run_kernel(jax.jit(layer), lhs, rhs, bias)
    reference = jax.vmap(functools.partial(
        matmul_reference, epilogue=Epilogue(activation="gelu", has_bias=True)),
        in_axes=(0, None, None))
    self.assert_close(out, reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), bias),
                      dtype=jnp.bfloat16)

  def test_inside_shard_map(self):
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
    lhs, rhs = base.operands(13, 128, 128, 128, jnp.float16)
    spec = jax.sharding.PartitionSpec
    run = jax.shard_map(functools.partial(matmul, config=SMALL_WS), mesh=mesh,
                        in_specs=(spec("x", None), spec()), out_specs=spec("x", None))
    out = self.run_kernel(jax.jit(run), lhs, rhs)
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=jnp.float16)

class ConfigChoiceTest(parameterized.TestCase):
  """The heuristic's configs and the operand copies they imply, for the 132 SMs of an
  H100 SXM or H200 that its constants were fitted on, on any host: on a GPU with another
  SM count (an H100 PCIe has 114) the heuristic rightly picks other tiles, which these
  cases would report as failures. Lowerings for the GPU run on CPU only."""

  def setUp(self):
    super().setUp()
    self.enter_context(testing.facts_of_the_fitted_gpu())

  def test_operands_are_copied_only_where_it_pays(self):
    """`tma_sizes` pads an operand whose minor dimension is off 128 bytes
    where the copy costs less than a narrower swizzle would slow the main
    loop: the small LHS of a long N, not the 65 MB (8192, 4000) RHS of a
    decode-size M (whose 64-byte swizzle makes the LHS tiles of these
    64-element K steps two segments wide, so its M = 100 is padded; the
    heuristic takes 32-element steps there). A major dimension needs only 8 rows
    (K = 80 of the RHS); a minor one off 32 bytes is always padded
    (N = 3000 and 2500 of the RHS). Arrays whose tiles are one segment wide
    (the (M, K) and (N, K) operands, 16-bit outputs) are copied as boxes,
    unpadded, unless their rows are off 16 bytes (N = 2500)."""
    f16, f32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
    nt = ops.OperandLayout(transpose_rhs=True)
    tn = ops.OperandLayout(transpose_lhs=True)
    for (m, k, n), layout, out_dtype, expected in (
        ((4096, 80, 4096), ops.NN, f16, ((4096, 80), (80, 4096), (4096, 4096))),
        ((4096, 4112, 4096), ops.NN, f16, ((4096, 4112), (4112, 4096), (4096, 4096))),
        ((100, 8192, 4000), ops.NN, f16, ((104, 8192), (8192, 4000), (100, 4000))),
        ((4096, 4096, 4000), ops.NN, f16, ((4096, 4096), (4096, 4032), (4096, 4000))),
        ((1000, 4096, 3000), ops.NN, f16, ((1000, 4096), (4096, 3008), (1000, 3000))),
        ((4999, 4096, 2500), ops.NN, f16, ((4999, 4096), (4096, 2560), (5000, 2560))),
        ((1, 8192, 8192), ops.NN, f16, ((1, 8192), (8192, 8192), (1, 8192))),
        ((2048, 48, 2048), ops.NN, f16, ((2048, 48), (48, 2048), (2048, 2048))),
        ((1000, 4096, 3000), nt, f16, ((1000, 4096), (3000, 4096), (1000, 3000))),
        ((100, 4096, 4096), tn, f16, ((4096, 128), (4096, 4096), (100, 4096))),
        ((1001, 4096, 4096), ops.NN, f32, ((1001, 4096), (4096, 4096), (1008, 4096)))):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=f16, layout=layout)
      copy_tiles = (128 if layout.transpose_lhs else 64, 64 if layout.transpose_rhs else 256)
      sizes = ops.tma_sizes(problem, out_dtype=out_dtype, k_multiple=1, tile_m=128, tile_n=256,
                            copy_tiles=copy_tiles, out_tile_n=64)
      self.assertEqual((sizes.lhs, sizes.rhs, sizes.out), expected,
                       f"{m}x{k}x{n} {layout.name} {out_dtype.name}")

  def test_rhs_boxes_off_sectors_are_padded_beyond_256_rows(self):
    """A (K, N) RHS in 64-column tiles is copied as boxes in place, except
    where its rows are off 32 bytes (N = 3000, 1000) and M is over 256: each
    row of CTA tiles rereads it, one L2 sector more per row, so it is padded."""
    for (m, k, n), rhs in (((256, 4096, 3000), (4096, 3000)), ((257, 4096, 3000), (4096, 3008)),
                           ((1000, 4096, 1000), (4096, 1024)),
                           ((1000, 4096, 4000), (4096, 4000))):  # Rows on 64 bytes.
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.float16))
      sizes = ops.tma_sizes(problem, out_dtype=jnp.float16, k_multiple=1, tile_m=64,
                            tile_n=128, copy_tiles=(64, 64), out_tile_n=64)
      self.assertEqual(sizes.rhs, rhs, f"{m}x{k}x{n}")

  def test_no_copy_for_a_swizzle_the_tiles_cannot_take(self):
    """32-element float16 K steps allow at most the 64-byte swizzle, under
    which the (M, K) LHS tiles are one segment, copied as boxes: the ragged
    M = 100 stays unpadded, though padding it for a 128-byte swizzle (which
    these tiles cannot take) would be modelled faster at 100x8192x8192."""
    problem = ops.MatmulProblem(m=100, k=8192, n=8192, dtype=jnp.dtype(jnp.float16))
    sizes = ops.tma_sizes(problem, out_dtype=jnp.float16, k_multiple=1, tile_m=128,
                          tile_n=128, copy_tiles=(32, 128), out_tile_n=64)
    self.assertEqual((sizes.lhs, sizes.rhs, sizes.out), ((100, 8192), (8192, 8192), (100, 8192)))

  def test_operands_read_in_place_lower_for_the_gpu(self):
    """Lowered for an H200 (on CPU, so Mosaic GPU checks every TMA against
    its arrays, swizzle and all): only the operands `tma_sizes` pads are
    copied, and the ragged edges of the LHS and output are copied as boxes."""
    if jax.default_backend() == "gpu":
      self.skipTest("checks the lowering on CPU")
    for (m, k, n), layout, pads in (((104, 8192, 4000), base.NN, 0),  # RHS: 64-byte swizzle.
                                    # And 32-element K steps: LHS M as boxes.
                                    ((100, 8192, 4000), base.NN, 0),
                                    ((160, 4096, 176), base.LAYOUTS[3], 0),  # LHS: 64 bytes.
                                    ((4096, 80, 4096), base.NN, 0),  # LHS K as boxes.
                                    # 128x64 tiles: the RHS too, in one-segment boxes.
                                    ((100, 4096, 1000), base.NN, 0),
                                    ((333, 48, 1000), base.LAYOUTS[1], 0),  # (N, K) RHS.
                                    ((104, 4096, 3000), base.NN, 0),
                                    # One-segment RHS tiles, multicast to clusters.
                                    ((1000, 4096, 3000), base.NN, 0),
                                    ((4999, 4096, 2500), base.NN, 1),  # RHS rows off 16 B.
                                    # Outputs at most 64 wide: 64-column CTA tiles read
                                    # an RHS of N = 64 or 48 in place (128-column ones
                                    # padded it to 128 columns).
                                    ((64, 4096, 64), base.NN, 0),
                                    ((4096, 4096, 64), base.NN, 0),
                                    ((1000, 4096, 48), base.NN, 0)):
      lhs, rhs = base.operands(47, m, k, n, jnp.float16, layout)
      run = jax.jit(functools.partial(matmul, transpose_lhs=layout.transpose_lhs,
                                      transpose_rhs=layout.transpose_rhs))
      with interpret.interpret_disabled():
        text = run.trace(lhs, rhs).lower(lowering_platforms=("cuda",)).as_text()
      self.assertEqual(text.count("stablehlo.custom_call @mosaic_gpu"), 1, f"{m}x{k}x{n}")
      self.assertEqual(text.count("stablehlo.pad"), pads, f"{m}x{k}x{n} {layout.name}")

  def test_random_problems_lower_for_the_gpu(self):
    """Drawn problems up to 16384 a side (`testing.random_size`), each layout
    and dtype, with a bias and an activation or not, on the heuristic's
    configs, lowered for an H200 on CPU: where Mosaic GPU checks every TMA
    copy, swizzle, wgmma and the SMEM size against the arrays (the
    interpreter does not), at the sizes that take the heuristic's large
    tiles, splits of K, clusters and transposed products."""
    if jax.default_backend() == "gpu":
      self.skipTest("checks the lowering on CPU")
    rng = np.random.default_rng(0)
    for _ in range(12):
      m, k, n = (testing.random_size(rng, 16384) for _ in range(3))
      dtype = (jnp.float16, jnp.bfloat16)[rng.integers(2)]
      layout = base.LAYOUTS[rng.integers(len(base.LAYOUTS))]
      activation = base.ACTIVATIONS[rng.integers(len(base.ACTIVATIONS))]
      args = [jax.ShapeDtypeStruct(layout.lhs_shape(m, k), dtype),
              jax.ShapeDtypeStruct(layout.rhs_shape(k, n), dtype)]
      if rng.integers(2):
        args.append(jax.ShapeDtypeStruct((n,), jnp.float32))
      run = functools.partial(matmul, activation=activation, transpose_lhs=layout.transpose_lhs,
                              transpose_rhs=layout.transpose_rhs)
      what = f"{m}x{k}x{n} {layout.name} {jnp.dtype(dtype).name} {activation} {len(args)} args"
      with self.subTest(what):
        self.assertGreaterEqual(testing.mosaic_kernel_count(testing.lowered_for_gpu(run, *args)),
                                1, what)

  def test_warpgroups_read_their_rhs_tiles_in_place(self):
    """Warpgroups that split N each load their own 64-column RHS tile, one
    segment wide, which TMA reads as boxes in place at an N off 64 columns:
    lowered for an H200 on CPU, no pad (one pad where M exceeds 256 rows and
    the rows are off 32 bytes, `operands.tma_sizes`)."""
    if jax.default_backend() == "gpu":
      self.skipTest("checks the lowering on CPU")
    config = TuningConfig(tile_m=64, tile_n=64, wg_dimension=MatmulDimension.N,
                          max_concurrent_steps=4, k_splits=4)
    self.assertEqual(config.rhs_tiles, 2)
    for (m, k, n), pads in (((16, 8192, 3000), 0), ((100, 4096, 1000), 0), ((7, 8192, 4040), 0),
                            ((1000, 4096, 1000), 1)):
      lhs, rhs = base.operands(48, m, k, n, jnp.float16, base.NN)
      run = jax.jit(functools.partial(kernel_call.ws_matmul, config=config))
      with interpret.interpret_disabled():
        text = run.trace(lhs, rhs).lower(lowering_platforms=("cuda",)).as_text()
      self.assertEqual(text.count("stablehlo.custom_call @mosaic_gpu"), 1, f"{m}x{k}x{n}")
      self.assertEqual(text.count("stablehlo.pad"), pads, f"{m}x{k}x{n}")

  def test_split_k_pads_no_operand(self):
    """A split K whose ranges do not divide K's steps (71 steps of 64 in 4
    ranges of 18; 63 steps, the last partial, in 4 of 16) copies neither
    operand: the last range reads past K, which TMA fills with zeros. It
    used to pad K to whole ranges, a copy of the weights that cost a decode
    step more than the split saved. Lowered for an H200 on CPU."""
    if jax.default_backend() == "gpu":
      self.skipTest("checks the lowering on CPU")
    config = TuningConfig(tile_m=64, tile_n=64, wg_dimension=MatmulDimension.N,
                          max_concurrent_steps=4, k_splits=4)
    for m, k, n in ((1, 4544, 4544), (16, 4000, 4096)):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.bfloat16))
      sizes = kernel_call.ws_tma_sizes(config, problem, jnp.bfloat16)
      self.assertEqual((sizes.lhs[1], sizes.rhs), (k, (k, n)), f"{m}x{k}x{n}")
      lhs, rhs = base.operands(49, m, k, n, jnp.bfloat16, base.NN)
      run = jax.jit(functools.partial(kernel_call.ws_matmul, config=config))
      with interpret.interpret_disabled():
        text = run.trace(lhs, rhs).lower(lowering_platforms=("cuda",)).as_text()
      self.assertEqual(text.count("stablehlo.pad"), 0, f"{m}x{k}x{n}")

  def test_heuristic_multicasts_one_segment_rhs_tiles(self):
    """Where M is over 256 and the heuristic's RHS tiles, several segments
    wide, would pad a (K, N) RHS (N = 3000, 4040) or take a narrower swizzle
    (N = 4000), it loads them as one-segment tiles multicast to clusters of
    two CTAs: lowered for an H200 on CPU, no pad. Aligned rows, a transposed
    RHS and rows off 16 bytes (N = 2500, padded either way) keep their config."""
    if jax.default_backend() == "gpu":
      self.skipTest("checks the lowering on CPU")
    for (m, k, n), layout, changed in (((1000, 4096, 3000), base.NN, True),
                                       ((1024, 4096, 3000), base.LAYOUTS[2], True),
                                       ((333, 4096, 3000), base.NN, True),
                                       ((700, 8192, 3000), base.NN, True),
                                       ((4096, 4096, 4040), base.NN, True),
                                       ((4096, 4096, 4000), base.NN, True),
                                       ((1000, 4096, 3072), base.NN, False),
                                       ((1000, 4096, 3000), base.LAYOUTS[1], False),
                                       ((4999, 4096, 2500), base.NN, False),
                                       ((200, 4096, 3000), base.NN, False)):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.float16), layout=layout)
      config = default_config(problem, jnp.float16)
      what = f"{m}x{k}x{n} {layout.name}"
      self.assertEqual((config.rhs_tile_n, config.cluster_m),
                       (64, 2) if changed else (None, 1), what)
      if changed:
        lhs, rhs = base.operands(49, m, k, n, jnp.float16, layout)
        run = jax.jit(functools.partial(kernel_call.ws_matmul, config=config, layout=layout))
        with interpret.interpret_disabled():
          text = run.trace(lhs, rhs).lower(lowering_platforms=("cuda",)).as_text()
        self.assertEqual(text.count("stablehlo.custom_call @mosaic_gpu"), 1, what)
        self.assertEqual(text.count("stablehlo.pad"), 0, what)

  def test_heuristic_weighs_rhs_pads_beyond_256_rows(self):
    """Where M is over 256 and the output has too few tiles for a wave of
    128x256 ones, the model weighs each tile's RHS pad against the extra
    wgmmas of reading it in place in one-segment tiles: 64x128 CTA tiles,
    which pad an RHS with rows off 32 bytes there, give way to wider tiles
    in clusters (700x8192x3000: 1.76x faster on an H200)."""
    for (m, k, n), expected in (((700, 8192, 3000), (128, 192, 1)),
                                ((1000, 4096, 1000), (128, 128, 2)),
                                ((1000, 8192, 1000), (128, 128, 2)),
                                ((333, 2048, 8200), (128, 256, 1))):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.float16))
      config = default_config(problem, jnp.float16)
      what = f"{m}x{k}x{n}"
      self.assertEqual((config.cta_tile_m, config.cta_tile_n, config.k_splits), expected, what)
      self.assertEqual((config.rhs_tile_n, config.cluster_m), (64, 2), what)
      self.assertEqual(kernel_call.ws_tma_sizes(config, problem, jnp.float16).rhs, (k, n), what)

  def test_heuristic_fills_the_sms(self):
    """128x256 CTA tiles while they make a full wave on 132 SMs, smaller ones below that."""
    for (m, k, n), cta in (((4096, 4096, 4096), (128, 256)), ((1024, 4096, 4096), (128, 256)),
                           ((512, 4096, 4096), (128, 128)), ((2048, 4096, 1024), (128, 128))):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.float16))
      config = default_config(problem, jnp.float16)
      self.assertEqual((config.cta_tile_m, config.cta_tile_n, config.k_splits), (*cta, 1),
                       f"{m}x{k}x{n}")
      self.assertEqual(config.schedule, Schedule.COOPERATIVE)

  def test_heuristic_fills_the_last_wave(self):
    """128x192 CTA tiles where they leave enough fewer SMs idle in the last
    wave than 128x256 ones (one wave of 128 tiles against 96 at
    1000x4096x3000; 5 waves against 4 at 4999x4096x2500); short K loops keep
    128-wide epilogue tiles rather than stages that hide nothing."""
    for (m, k, n), expected in (((1000, 4096, 3000), (128, 192, 4, 64)),
                                ((4999, 4096, 2500), (128, 192, 4, 64)),
                                ((4096, 4096, 4096), (128, 256, 3, 128)),
                                ((4096, 8192, 4096), (128, 256, 3, 128)),
                                ((4096, 80, 4096), (128, 256, 4, 128))):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.float16))
      config = default_config(problem, jnp.float16)
      self.assertEqual((config.cta_tile_m, config.cta_tile_n, config.max_concurrent_steps,
                        config.epi_tile_n), expected, f"{m}x{k}x{n}")
      kernel_call.check_ws_config(config, ops.pad_k(problem, config.tile_k), jnp.float16,
                                  has_bias=True)

  def assert_cta_tile_and_splits(self, shape, dtype, expected):
    """The heuristic gives `shape` the (CTA tile M, N, k_splits) `expected`, for
    an output of `dtype` and of float32, and the config runs with a bias."""
    m, k, n = shape
    problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(dtype))
    for out_dtype in (dtype, jnp.float32):
      config = default_config(problem, out_dtype)
      self.assertEqual((config.cta_tile_m, config.cta_tile_n, config.k_splits), expected,
                       f"{m}x{k}x{n} -> {jnp.dtype(out_dtype).name}")
      kernel_call.check_ws_config(config, problem, out_dtype, has_bias=True)

  def test_heuristic_splits_long_k_of_small_outputs(self):
    """Where even small tiles leave SMs idle and K is long, K is split so
    that (tile, K range) pairs make about one wave; each range >= 512 for
    CTA tiles up to 128 wide, >= 1024 for 192-wide ones, >= 2048 for wider
    ones."""
    for (m, k, n), expected in (((512, 16384, 1024), (128, 256, 8)),
                                ((256, 8192, 4096), (128, 256, 4)),
                                ((1024, 8192, 1024), (128, 256, 4)),
                                # 128x256 tiles in 8 ranges of 1024 would fill the
                                # SMs, but ran 15% slower on an H200.
                                ((512, 8192, 1024), (128, 128, 4)),
                                ((512, 4096, 4096), (128, 128, 1)),  # 128 tiles already.
                                ((1024, 2048, 1024), (64, 128, 1)),  # K too short to split.
                                # Few output tiles: ranges of 512 fill the SMs.
                                ((128, 32768, 128), (64, 128, 64)),
                                ((256, 2048, 1024), (64, 128, 4)),
                                ((333, 2048, 1111), (128, 128, 4)),
                                # 128x192 tiles in 4 ranges of 1024 ran 7% faster
                                # than unsplit 64x128 tiles.
                                ((333, 4096, 2048), (128, 192, 4)),
                                # Bound by HBM (the RHS): fewer partial bytes win.
                                ((128, 8192, 8192), (128, 128, 2)),
                                ((128, 16384, 4096), (128, 128, 4))):
      self.assert_cta_tile_and_splits((m, k, n), jnp.bfloat16, expected)

  def test_heuristic_small_tile_takes_the_widest_swizzle(self):
    """Where a (K, N) RHS's rows are on 64 bytes but not 128 (N = 2080, 4000
    or 1056), the 64x128 tile's RHS tiles, one 64-column tile per warpgroup,
    are one segment: copied as boxes in place under the 128-byte swizzle, so
    the model weighs it at its usual cost (700x4096x1056 and 200x4096x4000
    take it unsplit); larger tiles read that RHS with the 64-byte swizzle."""
    f16 = jnp.float16
    for (m, k, n), expected in (((700, 4096, 1056), (64, 128, 1)),
                                ((200, 4096, 4000), (64, 128, 1)),
                                # 17 tiles in 7 uneven ranges: 10.8 us, 11.8 in 4.
                                ((16, 8192, 2080), (64, 128, 7)),
                                ((333, 4096, 2080), (128, 192, 4)),
                                ((333, 4096, 2048), (128, 192, 4))):
      self.assert_cta_tile_and_splits((m, k, n), f16, expected)
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(f16))
      config = default_config(problem, f16)
      sizes = kernel_call.ws_tma_sizes(config, problem, f16)
      self.assertEqual(sizes.rhs, (k, n))
      swizzle = operand_swizzle(config, jax.ShapeDtypeStruct(sizes.lhs, f16),
                                jax.ShapeDtypeStruct(sizes.rhs, f16))
      self.assertEqual(swizzle, 128 if config.tile_n == 64 or n % 64 == 0 else 64,
                       f"{m}x{k}x{n}")

  def test_heuristic_reads_a_ragged_rhs_in_place(self):
    """Where wider tiles would pad a (K, N) RHS whose N is off 64 columns and
    M is at most 256, tiles with one-segment RHS tiles read it in place as
    boxes: 64x128 CTA tiles (a 64-column RHS tile per warpgroup) where M fits
    one row of them, else 128x64 ones. Aligned N and an (N, K) RHS keep the
    model's other tiles and the RHS pads of a ragged N (larger M:
    `test_heuristic_multicasts_one_segment_rhs_tiles`)."""
    f16 = jnp.float16
    nt = ops.OperandLayout(transpose_rhs=True)
    for (m, k, n), layout, in_place_tile in (((128, 8192, 3000), ops.NN, (128, 64)),
                                             ((200, 4096, 3000), ops.NN, (128, 64)),
                                             ((100, 4096, 1000), ops.NN, (128, 64)),
                                             ((64, 8192, 4040), ops.NN, (64, 128)),
                                             ((16, 8192, 4040), ops.NN, (64, 128)),
                                             ((1, 8192, 3000), ops.NN, (64, 128)),
                                             ((128, 8192, 4096), ops.NN, None),  # Aligned.
                                             ((128, 8192, 3000), nt, None)):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(f16), layout=layout)
      for out_dtype in (f16, jnp.float32):
        config = default_config(problem, out_dtype)
        what = f"{m}x{k}x{n} {layout.name} -> {jnp.dtype(out_dtype).name}"
        kernel_call.check_ws_config(config, ops.pad_k(problem, config.tile_k * config.k_splits),
                                    out_dtype, has_bias=True)
        rhs = kernel_call.ws_tma_sizes(config, problem, out_dtype).rhs
        if in_place_tile:
          self.assertEqual((config.cta_tile_m, config.cta_tile_n), in_place_tile, what)
          self.assertEqual(rhs, (k, n), what)
        else:
          self.assertNotEqual((config.cta_tile_m, config.cta_tile_n), (128, 64), what)
          padded_n = ops.round_up(n, 64) if layout == ops.NN else n
          self.assertEqual(rhs, layout.rhs_shape(k, padded_n), what)

  def test_heuristic_decode_tile(self):
    """M of 16 rows or fewer with outputs wider than 8192 columns (narrower
    ones run as their transpose: `test_heuristic_transposed_decode`) may take
    64x256 CTA tiles (more RHS bytes in flight per stage) in K ranges of 2048
    or more; M = 64 keeps 64x128 in ranges, which ran faster there. Up to 64
    rows, weights wide enough for a wave of 128x256 tiles take unsplit 64x256
    ones, not 128-row tiles that compute mostly rows past M (16x8192x57344:
    0.70x jnp.dot before, 0.92x after, on an H200), or unsplit 64x512 ones
    where those stream the weights in fewer waves than 64x256 tiles, whose
    last wave would be part-empty (16x8192x57344 again: 0.90x -> 0.98x;
    16x5120x55296: 0.93x -> 1.01x)."""
    for (m, k, n), expected in (((1, 8192, 16384), (64, 256, 2)),
                                ((16, 8192, 10240), (64, 256, 3)),
                                # Not transposed at 17 rows. At 16 (16x8192x4096),
                                # 64x256 tiles in 8 ranges of 1024 ran 7% slower.
                                ((17, 8192, 4096), (64, 128, 4)),
                                ((64, 8192, 8192), (64, 128, 2)),
                                ((16, 8192, 57344), (64, 512, 1)),
                                ((16, 5120, 55296), (64, 512, 1)),
                                ((64, 3584, 37888), (64, 512, 1)),
                                # 4.5 waves of 64x256 tiles, 2.3 of 64x512 ones.
                                ((16, 5120, 152064), (64, 256, 1)),
                                ((64, 3584, 152064), (64, 256, 1)),
                                # 2.2 waves of 64x256 tiles: 1.12x faster than
                                # 1.1 of 64x512, 1.27x than 128x192 tiles.
                                ((8, 8192, 73728), (64, 256, 1)),
                                # One wave of 64x256 tiles: 64x512 ones ran 1.28x slower.
                                ((64, 4096, 28672), (64, 256, 1)),
                                # One 64-row tile more: 128-row tiles again.
                                ((65, 4096, 57344), (128, 256, 1))):
      self.assert_cta_tile_and_splits((m, k, n), jnp.float16, expected)

  def test_heuristic_short_k_step(self):
    """A K that one 16- or 32-element step covers (LoRA ranks) takes that
    step, with 64-column epilogue tiles, instead of a 64-element step of
    mostly zero-filled columns (4096x8x4096: 0.65x jnp.dot before, 0.82x
    after, on an H200), on the cooperative schedule where ping-pong's tile
    would be taken too (2048x8x11008: 1.17x faster on an H100); longer K
    and split K keep their steps."""
    for (m, k, n), layout, expected in (((4096, 8, 4096), base.NN, (16, 64)),
                                        ((4096, 8, 4096), base.LAYOUTS[1], (16, 64)),
                                        ((4096, 16, 4096), base.NN, (16, 64)),
                                        ((4096, 24, 4096), base.NN, (32, 64)),
                                        ((4096, 32, 4096), base.LAYOUTS[3], (32, 64)),
                                        ((4096, 48, 4096), base.NN, (64, 128)),
                                        ((4096, 8, 4096), base.LAYOUTS[2], (64, 128)),
                                        ((64, 16, 64), base.NN, (16, 32)),
                                        # Where ping-pong's tile would be taken.
                                        ((4096, 16, 3584), base.LAYOUTS[1], (16, 64)),
                                        ((2048, 8, 11008), base.NN, (16, 64)),
                                        ((4096, 32, 14336), base.NN, (32, 64))):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.bfloat16), layout=layout)
      config = default_config(problem, jnp.bfloat16)
      what = f"{m}x{k}x{n} {layout.name}"
      self.assertEqual((config.tile_k, config.epi_tile_n), expected, what)
      if config.tile_k < 64:
        self.assertEqual(config.schedule, Schedule.COOPERATIVE, what)
      kernel_call.check_ws_config(config, ops.pad_k(problem, config.tile_k), jnp.bfloat16,
                                  has_bias=True)


  def test_heuristic_narrow_outputs(self):
    """Outputs at most 64 columns wide take 64-column CTA tiles, 128x64 or
    64x64 where M fits 64 rows, in the split of K the model has fastest
    (ranges down to 256) and 8 stages: no tile multiplies zero columns past
    N (before, 128x128 or 64x128 tiles, 0.48-0.98x cuBLAS on an H200)."""
    for (m, k, n), expected in (((64, 4096, 64), (64, 64, 16)),
                                ((64, 4096, 16), (64, 64, 16)),
                                # 8 tiles in 13 uneven ranges (5.5 us on an H200 as in 16).
                                ((1000, 4096, 64), (128, 64, 13)),
                                ((2048, 4096, 32), (128, 64, 8)),
                                ((4096, 4096, 64), (128, 64, 4)),
                                # 16 columns: 128x16 over the RHS transposed first.
                                ((4096, 14336, 16), (128, 16, 4)),
                                ((8192, 4096, 64), (128, 64, 1)),  # 64 tiles: a split lost.
                                ((32768, 4096, 48), (128, 64, 1))):
      self.assert_cta_tile_and_splits((m, k, n), jnp.float16, expected)
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.float16))
      self.assertEqual(default_config(problem, jnp.float16).max_concurrent_steps, 8)

  def test_heuristic_sixteen_column_tiles_over_a_transposed_rhs(self):
    """Outputs at most 16 columns wide with an (N, K) RHS (NT, TT) above 64
    rows take 128x16 CTA tiles in the 128x64 tile's split of K, as does a
    (K, N) RHS transposed first (`TuningConfig.transpose_rhs_first`); wider
    outputs and decode-size M keep their tiles."""
    nn, nt, tn, tt = base.LAYOUTS[0], base.LAYOUTS[1], base.LAYOUTS[2], base.LAYOUTS[3]
    for (m, k, n), layout, expected in (((4096, 4096, 8), nt, (128, 16, 4)),
                                        ((4096, 4096, 16), tt, (128, 16, 4)),
                                        ((4096, 18944, 16), nt, (128, 16, 4)),
                                        ((4096, 8, 16), nt, (128, 16, 1)),
                                        ((4096, 4096, 16), nn, (128, 16, 4)),
                                        ((4096, 4096, 16), tn, (128, 16, 4)),
                                        ((4096, 4096, 32), nt, (128, 64, 4)),
                                        ((64, 4096, 16), nt, (64, 64, 16))):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.bfloat16), layout=layout)
      for out_dtype in (jnp.bfloat16, jnp.float32):
        config = default_config(problem, out_dtype)
        self.assertEqual((config.cta_tile_m, config.cta_tile_n, config.k_splits), expected,
                         f"{m}x{k}x{n} {layout.name} -> {jnp.dtype(out_dtype).name}")
        kernel_call.check_ws_config(config, ops.pad_k(problem, config.tile_k), out_dtype,
                                    has_bias=True)

  def test_heuristic_transposed_decode(self):
    """At most 16 rows of an LHS of either layout, with an output 65-8192
    columns wide and weight rows on 128 bytes, run as the transposed product
    (`TuningConfig.swap_operands`) in the 16-column tiles of an (N', K) RHS:
    the activations' rows are never read past M as a 64-row LHS tile
    (16x4096x4096 on an H100: 0.76x -> 1.06x jnp.dot), and a (K, M) LHS is
    transposed first. Wider outputs, more rows, outputs at most 64 columns
    wide, weight rows off 128 bytes and kernels that run only the
    cooperative schedule on the problem as given keep their configs."""
    nn, nt, tn, tt = base.LAYOUTS
    self.check_problem_rewrite(
        "swap_operands",
        (((16, 4096, 4096), nn, True), ((1, 4544, 4544), nn, True),
         ((16, 8192, 128), nn, True), ((16, 8192, 8192), nn, True),
         ((8, 4096, 4096), nt, True), ((16, 8192, 8193), nn, False),
         ((17, 4096, 4096), nn, False), ((16, 4096, 4096), tn, True),
         ((8, 4096, 4096), tt, True), ((17, 4096, 4096), tn, False),
         ((16, 4096, 64), nn, False),
         # Weight rows off 128 bytes: read in place.
         ((1, 8192, 3000), nn, False)),
        lambda problem, out_dtype: default_config(problem.transposed_product(), jnp.float32))

  def test_heuristic_transposes_a_narrow_rhs_first(self):
    """Outputs at most 16 columns wide over a (K, N) RHS, past 512 rows, have
    XLA transpose the RHS first (`TuningConfig.transpose_rhs_first`) and take
    the config of the (N, K) RHS: 16-column tiles of whole 128-byte rows
    along K. An (N, K) RHS, wider outputs, 512 rows or fewer (on an H100
    256x4096x16 ran 8% slower, 512x4096x16 3%) and kernels that run only the
    cooperative schedule on the problem as given do not."""
    nn, nt, tn, tt = base.LAYOUTS
    self.check_problem_rewrite(
        "transpose_rhs_first",
        (((4096, 4096, 8), nn, True), ((3584, 4096, 16), tn, True),
         ((513, 200, 16), nn, True), ((4096, 4096, 16), nt, False),
         ((4096, 4096, 16), tt, False), ((4096, 4096, 17), nn, False),
         ((512, 4096, 16), nn, False), ((256, 4096, 16), nn, False),
         ((64, 4096, 16), nn, False)),
        lambda problem, out_dtype: default_config(problem.with_rhs_transposed(), out_dtype))
    config = default_config(ops.MatmulProblem(m=4096, k=4096, n=16,
                                              dtype=jnp.dtype(jnp.bfloat16)), jnp.bfloat16)
    with self.assertRaisesRegex(ValueError, "exclude each other"):
      dataclasses.replace(config, swap_operands=True)

  def check_problem_rewrite(self, field: str, cases, rewritten_config) -> None:
    """For each ((M, K, N), layout, expected) of `cases`, that the heuristic's
    config sets `field` (a rewrite of `ws_matmul`'s plain product) as
    expected, that the config is valid, and where it is set, that the config
    is `rewritten_config(problem, out_dtype)` with it; kernels that run only
    the cooperative schedule never get it, and the gated unit, the grouped
    matmul, column scales and the rings reject it."""
    for (m, k, n), layout, expected in cases:
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.bfloat16), layout=layout)
      what = f"{m}x{k}x{n} {layout.name}"
      for out_dtype in (jnp.bfloat16, jnp.float32):
        config = default_config(problem, out_dtype)
        self.assertEqual(getattr(config, field), expected, what)
        kernel_call.check_ws_config(config, ops.pad_k(problem, config.tile_k), out_dtype,
                                    has_bias=True)
        if expected:
          self.assertEqual(config, dataclasses.replace(rewritten_config(problem, out_dtype),
                                                       **{field: True}), what)
          for kwargs in (dict(gated=True), dict(grouped=True), dict(has_column_scales=True),
                         dict(kernel="all_gather_matmul")):
            with self.assertRaisesRegex(ValueError, f"{field} runs only in ws_matmul"):
              kernel_call.check_ws_config(config, problem, jnp.bfloat16, **kwargs)
      self.assertFalse(getattr(default_config(problem, jnp.bfloat16, cooperative_only=True),
                               field))

  def test_heuristic_stages(self):
    """Small unsplit tiles get 6 stages (5 beside float32 staging tiles, and
    where each SM runs several 128x128 tiles of fewer than 256 K steps; 4 for
    64x128 tiles in one wave of at most 64 K steps); split K and large tiles
    fewer."""
    f16, f32 = jnp.float16, jnp.float32
    for (m, k, n), out_dtype, expected in (((256, 8192, 8192), f16, (128, 128, 1, 6)),
                                           ((2048, 5120, 5120), f16, (128, 128, 1, 5)),
                                           # 256 K steps, and one wave of 132 tiles.
                                           ((2048, 16384, 5120), f16, (128, 128, 1, 6)),
                                           ((768, 2048, 2816), f16, (128, 128, 1, 6)),
                                           ((16, 8192, 3000), f16, (64, 128, 5, 4)),
                                           ((100, 8192, 3000), f16, (128, 64, 2, 4)),
                                           ((256, 8192, 8192), f32, (128, 128, 1, 5)),
                                           # One wave of 64x128 tiles: 36, 64, 96 K steps.
                                           ((256, 2304, 4096), f16, (64, 128, 1, 4)),
                                           ((512, 4096, 2048), f16, (64, 128, 1, 4)),
                                           ((320, 6144, 3072), f16, (64, 128, 1, 6)),
                                           ((448, 6144, 4352), f16, (64, 128, 1, 6)),  # 238 tiles.
                                           ((128, 8192, 8192), f16, (128, 128, 2, 4)),
                                           ((4096, 4096, 4096), f16, (128, 256, 1, 3))):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(f16))
      config = default_config(problem, out_dtype)
      self.assertEqual((config.cta_tile_m, config.cta_tile_n, config.k_splits,
                        config.max_concurrent_steps), expected, f"{m}x{k}x{n} -> {out_dtype}")
      kernel_call.check_ws_config(config, problem, out_dtype, has_bias=True)

  def test_heuristic_k_step_of_one_segment(self):
    """Where the operands take the 64-byte swizzle (N = 4000 or 1056 of a
    (K, N) RHS) and M is ragged, 32-element K steps with twice the stages,
    so the LHS is read in place; elsewhere 64-element steps."""
    f16 = jnp.float16
    nt = ops.OperandLayout(transpose_rhs=True)
    tn = ops.OperandLayout(transpose_lhs=True)
    for (m, k, n), layout, expected in (((100, 8192, 4000), ops.NN, (32, 8)),
                                        # 64x128 tiles: one-segment RHS tiles, 128 bytes.
                                        ((7, 8192, 4000), ops.NN, (64, 4)),
                                        ((150, 4096, 1056), ops.NN, (32, 8)),
                                        ((104, 8192, 4000), ops.NN, (64, 4)),  # M on 8 rows.
                                        ((100, 8192, 4000), nt, (64, 4)),  # 128-byte swizzle.
                                        # 128x64 tiles: RHS in place, 128 bytes.
                                        ((100, 8192, 3000), ops.NN, (64, 4)),
                                        ((4000, 8192, 100), tn, (64, 4))):  # K-major LHS.
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(f16), layout=layout)
      for out_dtype in (f16, jnp.float32):
        config = default_config(problem, out_dtype)
        what = f"{m}x{k}x{n} {layout.name} -> {jnp.dtype(out_dtype).name}"
        self.assertEqual((config.tile_k, config.max_concurrent_steps), expected, what)
        kernel_call.check_ws_config(config, ops.pad_k(problem, config.tile_k * config.k_splits),
                                    out_dtype, has_bias=True)
        sizes = kernel_call.ws_tma_sizes(config, problem, out_dtype)
        if expected[0] == 32:
          self.assertEqual(sizes.lhs, (m, k), what)

  def test_heuristic_epilogue_tiles_for_a_ragged_output(self):
    """A 16-bit output whose rows are off 64 bytes (N = 4040, 3000, 1000)
    gets 64-column epilogue tiles, stored as boxes in place, rather than
    128-column ones, which would pad it and slice the result; outputs that
    128-column tiles store in place keep them."""
    f16, f32 = jnp.float16, jnp.float32
    for (m, k, n), out_dtype, epi_tile_n in (((4096, 4096, 4040), f16, 64),
                                             ((8192, 4096, 3000), f16, 64),
                                             ((4096, 4096, 1000), f16, 64),
                                             # 64-column RHS tiles, as the next test has it.
                                             ((4096, 4096, 4000), f16, 64),
                                             ((4096, 4096, 4096), f16, 128),
                                             ((4096, 4096, 4040), f32, 64)):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(f16))
      config = default_config(problem, out_dtype)
      what = f"{m}x{k}x{n} -> {jnp.dtype(out_dtype).name}"
      self.assertEqual(config.epi_tile_n, epi_tile_n, what)
      self.assertEqual(kernel_call.ws_tma_sizes(config, problem, out_dtype).out, (m, n), what)
      kernel_call.check_ws_config(config, problem, out_dtype, has_bias=True)

  def test_heuristic_takes_pingpong_where_its_waves_allow(self):
    """Ping-pong's 128x192 tiles where they leave the busiest SM no more work
    than 128x256 ones, at most 5% more where K <= 2048, or at most 12.5%
    more where K is 256-1024 (4-16 K steps)."""
    for (m, k, n), schedule in (((16384, 1024, 8192), Schedule.PINGPONG),
                                ((8192, 1024, 4096), Schedule.PINGPONG),  # 3% more work.
                                # 12.5% more work: at K = 256-1024, not at K = 2048
                                # nor at one or two K steps.
                                ((4096, 1024, 4096), Schedule.PINGPONG),
                                ((2048, 512, 4096), Schedule.PINGPONG),
                                ((4096, 256, 4096), Schedule.PINGPONG),
                                ((4096, 2048, 4096), Schedule.COOPERATIVE),
                                ((4096, 128, 4096), Schedule.COOPERATIVE),
                                # Long K: 1% less work, 1.6% less, the same, 1.6% less.
                                ((8192, 4096, 14336), Schedule.PINGPONG),
                                ((16384, 4096, 8192), Schedule.PINGPONG),
                                ((8192, 4096, 6144), Schedule.PINGPONG),
                                ((8192, 8192, 8192), Schedule.PINGPONG),  # 1.6% less.
                                # Long K: 3% more work (4224 columns for 4096), 1.9% more.
                                ((8192, 14336, 4096), Schedule.COOPERATIVE),
                                ((4096, 8192, 14336), Schedule.COOPERATIVE),
                                # Equal work, but 128x192 tiles would pad the RHS (N off
                                # 64 columns) that the cooperative ones read in place.
                                ((2048, 4096, 3000), Schedule.COOPERATIVE)):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.bfloat16))
      for out_dtype in (jnp.bfloat16, jnp.float32):
        config = default_config(problem, out_dtype)
        self.assertEqual(config.schedule, schedule, f"{m}x{k}x{n}")

  def test_heuristic_orders_short_k_pingpong_tiles_along_the_longer_output_side(self):
    """Weight gradients at a few hundred tokens (K <= 512) take ping-pong's
    tiles; where the output is wider than tall they advance along N
    (8192x256x28672 TN on an H100: 9% faster), elsewhere along M as before
    (28672x256x8192: 7% faster along M), and so does a longer K."""
    layout = ops.OperandLayout(transpose_lhs=True)
    for (m, k, n), minor in (((8192, 256, 28672), MatmulDimension.N),
                             ((5120, 512, 13824), MatmulDimension.N),
                             # 12.5% more work than 128x256 tiles (K <= 1024).
                             ((2048, 512, 8192), MatmulDimension.N),
                             ((28672, 256, 8192), MatmulDimension.M),
                             ((13824, 512, 5120), MatmulDimension.M),
                             ((8192, 1024, 28672), MatmulDimension.M),
                             ((8192, 4096, 14336), MatmulDimension.M)):
      problem = ops.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.bfloat16), layout=layout)
      config = default_config(problem, jnp.bfloat16)
      self.assertEqual((config.schedule, config.grid_minor_dim), (Schedule.PINGPONG, minor),
                       f"{m}x{k}x{n}")

  def test_heuristic_weighs_128x128_tiles_against_a_wave_of_larger_ones(self):
    """Where 128x256 and ping-pong's 128x192 tiles take 3-4 waves, 128x128
    tiles leave the busiest SM 17% fewer elements, 8% less time at their
    cost per multiply-add: 2048x4096x5120 took ping-pong's tiles (126.2 us on
    an H200; 128x128: 115.3). Where they do not, 128x256 or ping-pong stays."""
    for (m, k, n), cta_tile in (((2048, 4096, 5120), (128, 128)),
                                ((1024, 8192, 10240), (128, 128)),
                                ((4096, 4096, 2560), (128, 128)),
                                ((4096, 4096, 4096), (128, 256)),
                                ((8192, 4096, 14336), (128, 192))):
      self.assert_cta_tile_and_splits((m, k, n), jnp.bfloat16, (*cta_tile, 1))

  def test_heuristic_splits_k_steps_unevenly(self):
    """K's steps need not divide into the ranges of a split: 1x4544x4544
    (71 steps, a prime count) was left unsplit on 36 of 132 SMs, 19.1 us on an
    H200; in 3 ranges of 24 steps (the last ending past K), 14.7 us. Both
    problems now run as their transpose (`test_heuristic_transposed_decode`),
    whose 128x16 tiles of out.T split K the same way."""
    for (m, k, n), expected in (((1, 4544, 4544), (128, 16, 3)),
                                ((16, 5120, 5120), (128, 16, 3))):  # 80 steps: 17.7 -> 15.3 us.
      self.assert_cta_tile_and_splits((m, k, n), jnp.bfloat16, expected)


class BadInputTest(parameterized.TestCase):
  """Errors come from our checks, before tracing or compiling anything."""

  def test_operand_errors(self):
    a = jnp.zeros((128, 64), jnp.float16)
    cases = [
        ((a, jnp.zeros((128, 64), jnp.float16)), "K of lhs and rhs differ"),
        ((a, jnp.zeros((64, 64), jnp.bfloat16)), "dtypes differ"),
        ((a.astype(jnp.float32), jnp.zeros((64, 64), jnp.float32)), "lhs.dtype=float32"),
        ((a[None], jnp.zeros((64, 64), jnp.float16)), "lhs must be 2-D"),
    ]
    for fn in (matmul, pipelined_matmul):
      for args, message in cases:
        with self.assertRaisesRegex(ValueError, message):
          fn(*args)
    # The pipelined kernel does not pad K (matmul does).
    with self.assertRaisesRegex(ValueError, "K=40 must be a multiple of tile_k=64"):
      pipelined_matmul(jnp.zeros((128, 40), jnp.float16), jnp.zeros((40, 64), jnp.float16))
    # A stored layout that does not match the flags: K is lhs.shape[0] when transposed.
    with self.assertRaisesRegex(ValueError, r"K of lhs and rhs differ.*lhs stored as \(K, M\)"):
      matmul(a, jnp.zeros((64, 32), jnp.float16), transpose_lhs=True)

  def test_config_errors(self):
    with self.assertRaisesRegex(ValueError, "tile_m=96"):
      TuningConfig(tile_m=96)
    with self.assertRaisesRegex(ValueError, "delay_release=2 must be smaller"):
      PipelinedConfig(max_concurrent_steps=2, delay_release=2)
    with self.assertRaisesRegex(ValueError, "max_concurrent_steps must be an int >= 1"):
      PipelinedConfig(max_concurrent_steps=0)
    with self.assertRaisesRegex(ValueError, "tile_n=512 exceeds"):
      PipelinedConfig(tile_n=512)
    with self.assertRaisesRegex(ValueError, "needs 256 registers per thread"):
      PipelinedConfig(tile_n=256)
    with self.assertRaisesRegex(ValueError, "activation='tanh'"):
      matmul(jnp.zeros((64, 64), jnp.float16), jnp.zeros((64, 64), jnp.float16),
             activation="tanh")
    lhs, rhs = jnp.zeros((512, 4096), jnp.float16), jnp.zeros((4096, 512), jnp.float16)
    with self.assertRaisesRegex(ValueError, "shared memory.*lhs_smem"):
      ws_matmul(lhs, rhs, config=TuningConfig(tile_m=64, tile_n=256, max_concurrent_steps=6,
                                              wg_dimension=MatmulDimension.M))
    with self.assertRaisesRegex(ValueError, "needs 256 registers per thread"):
      TuningConfig(tile_m=128, tile_n=256)
    with self.assertRaisesRegex(ValueError, "max_concurrent_steps=17 is too deep.*at most 16"):
      TuningConfig(max_concurrent_steps=17, schedule=Schedule.PINGPONG)
    with self.assertRaisesRegex(ValueError, "multiple of tile_k=128"):
      pipelined_matmul(jnp.zeros((64, 192), jnp.float16), jnp.zeros((192, 64), jnp.float16),
                       config=PipelinedConfig(tile_k=128))
    with self.assertRaisesRegex(ValueError, r"bias must have shape \(N,\)=\(512,\)"):
      matmul(lhs, rhs, jnp.zeros((7,), jnp.float16))
    for dtype in (jnp.int32, jnp.bool_, jnp.complex64):
      with self.assertRaisesRegex(ValueError, "bias.dtype=.* must be a real float dtype"):
        matmul(lhs, rhs, jnp.zeros((512,), dtype))
    for config in (dict(tile_m=64), Fp8Config()):
      with self.assertRaisesRegex(ValueError, "config must be a TuningConfig, got"):
        matmul(lhs, rhs, config=config)
    with self.assertRaisesRegex(ValueError, "k_splits=0 must be an int >= 1"):
      TuningConfig(k_splits=0)
    with self.assertRaisesRegex(ValueError, "k_splits=2 needs schedule=Schedule.COOPERATIVE"):
      TuningConfig(k_splits=2, schedule=Schedule.PINGPONG)
    with self.assertRaisesRegex(ValueError, "rhs_tile_n=48 must divide tile_n=128"):
      TuningConfig(rhs_tile_n=48)
    with self.assertRaisesRegex(ValueError, "rhs_tile_n=32 .* multiple of epi_tile_n=64"):
      TuningConfig(rhs_tile_n=32)
    with self.assertRaisesRegex(ValueError, "tile_k=16 must be a multiple of 64 for this "
                                "layout"):
      matmul(jnp.zeros((16, 512), jnp.float16), jnp.zeros((16, 512), jnp.float16),
             transpose_lhs=True, config=TuningConfig(tile_k=16))
    with self.assertRaisesRegex(ValueError, r"cluster_m=4 must be one of \(1, 2\)"):
      TuningConfig(cluster_m=4)
    with self.assertRaisesRegex(ValueError, "cluster_m=2 needs schedule=Schedule.COOPERATIVE"):
      TuningConfig(cluster_m=2, schedule=Schedule.PINGPONG)
    with self.assertRaisesRegex(ValueError, "chain_tiles=True needs schedule=Schedule.COOPERATIVE"):
      TuningConfig(chain_tiles=True, schedule=Schedule.PINGPONG)
    with self.assertRaisesRegex(ValueError, "chain_tiles=1 must be a bool"):
      TuningConfig(chain_tiles=1)

  def test_operand_swizzles_must_match(self):
    """A K tile narrower than 128 bytes would give the pipelined kernels'
    LHS a narrower swizzle than their RHS, which Mosaic GPU rejects with an
    opaque layout error. The warp-specialized kernels give both tiles the
    swizzle both allow (`config.operand_swizzle`), so they take it (their
    GPU cases are `test_k_steps_of_one_narrow_segment`)."""
    lhs, rhs = jnp.zeros((256, 512), jnp.bfloat16), jnp.zeros((512, 256), jnp.bfloat16)
    problem = ops.check_operands(lhs, rhs)
    for call in (pipelined_matmul, pallas_call_matmul):
      with self.assertRaisesRegex(ValueError, "tile_k=32 gives bfloat16 LHS tiles a 64-byte "
                                  "swizzle.*use tile_k=64"):
        call(lhs, rhs, config=PipelinedConfig(tile_m=64, tile_n=128, tile_k=32))
    for config in (TuningConfig(tile_k=32), TuningConfig(tile_k=32, schedule=Schedule.PINGPONG)):
      kernel_call.check_ws_config(config, problem, jnp.bfloat16)


if __name__ == "__main__":
  absltest.main()
