"""The cooperative schedule of `ws_matmul`, in interpret mode and on a GPU."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized

from core import testing
from pipelines import (
    Epilogue,
    MatmulDimension,
    TuningConfig,
    emit_cooperative_matmul,
    matmul,
    matmul_reference,
    persistent_kernel,
    ws_matmul,
)
from pipelines import matmul_test_base as base

# Small tiles keep the interpreter fast; the GPU runs the same code at real
# sizes (`test_real_sizes_and_epilogues`).
SMALL_WS = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                        epi_tile_m=64, epi_tile_n=32, grid_tile_width=2)


class CooperativeMatmulTest(base.MatmulTestBase):

  def run_matmul(self, lhs, rhs, bias=None, *, epilogue=Epilogue(), out_dtype=None,
                 config_fields=None, layout=base.NN):
    config = dataclasses.replace(SMALL_WS, **(config_fields or {}))
    return ws_matmul(lhs, rhs, bias, config=config, epilogue=epilogue, out_dtype=out_dtype,
                     layout=layout)

  @parameterized.product(dtype=base.DTYPES, wg_dimension=list(MatmulDimension),
                         grid_minor_dim=list(MatmulDimension))
  def test_warpgroup_split_and_tile_order(self, dtype, wg_dimension, grid_minor_dim):
    self.check((256, 128, 256), dtype, seed=3,
               config_fields=dict(wg_dimension=wg_dimension, grid_minor_dim=grid_minor_dim))

  @parameterized.parameters(
      # 8 CTA tiles on 3 blocks (3, 3, 2 each): each block's pipelines reuse
      # the same slots and barriers tile after tile.
      (3, (256, 128, 256), 2, Epilogue(activation="gelu", has_bias=True)),
      (2, (256, 192, 128), 2, Epilogue()),  # 3 K steps through 2 slots.
  )
  def test_several_tiles_per_block(self, num_blocks, shape, steps, epilogue):
    self.check(shape, jnp.bfloat16, seed=19, epilogue=epilogue, num_blocks=num_blocks,
               config_fields=dict(max_concurrent_steps=steps))

  @parameterized.parameters(
      # 8 CTA tiles on 3 blocks (3, 3, 2 each), 4 K steps through 2 slots.
      (3, (256, 256, 256), 2, 1, Epilogue(activation="gelu", has_bias=True)),
      # One block runs all 4 tiles; 2 K steps through 2 slots.
      (1, (256, 128, 128), 2, 1, Epilogue()),
      # 4 tiles on 3 blocks, one of them with a single tile, which begins and
      # ends its chain; 2 K ranges of 2 steps each.
      (3, (128, 256, 128), 2, 2, Epilogue()),
      # 3 K steps through 3 slots.
      (2, (256, 192, 128), 3, 1, Epilogue(has_bias=True)),
      # 2-CTA clusters, whose blocks share the RHS slots: 4 clusters' tiles
      # on 2 clusters.
      (4, (512, 128, 256), 2, 1, Epilogue(), 2),
  )
  def test_chained_tiles(self, num_blocks, shape, steps, k_splits, epilogue, cluster_m=1):
    """`chain_tiles`: each block's tiles on one ring of slots, the next
    tile's loads issued while the last one's K loop and epilogue finish."""
    fields = dict(max_concurrent_steps=steps, k_splits=k_splits, cluster_m=cluster_m,
                  chain_tiles=True)
    config = dataclasses.replace(SMALL_WS, **fields)
    k_steps = config.split_k_steps(shape[1])
    self.assertEqual(k_steps % steps, 0, "the test must take the chained path")
    self.check(shape, jnp.bfloat16, seed=61, epilogue=epilogue, num_blocks=num_blocks,
               config_fields=fields)

  @parameterized.parameters(*base.ODD_EPILOGUE_TILINGS)
  def test_odd_epilogue_tilings_split_along_m(self, **tiling):
    """The base case splits N between the warpgroups; this one M."""
    fields = dict(tiling, wg_dimension=MatmulDimension.M)
    config = dataclasses.replace(SMALL_WS, **fields)
    shape = (4 * config.cta_tile_m, 64, 2 * config.cta_tile_n)
    self.check(shape, jnp.bfloat16, seed=23, config_fields=fields, num_blocks=2,
               epilogue=Epilogue(activation="relu", has_bias=True))

  def test_warpgroup_rhs_tiles_narrower_than_a_segment_multiple(self):
    """Warpgroups that split N each load an RHS tile of their own, so 96-column
    warpgroup tiles (three 64-byte segments, not a whole number of 128-byte
    ones) run, with a ragged N."""
    self.check((128, 128, 360), jnp.float16, seed=51,
               config_fields=dict(tile_n=96, epi_tile_n=32, wg_dimension=MatmulDimension.N))

  def test_wide_decode_tile(self):
    """The heuristic's widest decode tile, two 64x256 warpgroup tiles along N
    (64x512 CTA tiles) in 2 stages: decode-size M, a ragged N whose 3 CTA
    tiles take turns on 2 blocks, 4 K steps through the 2 slots."""
    self.check((16, 256, 1100), jnp.bfloat16, seed=57, num_blocks=2,
               config_fields=dict(tile_n=256, epi_tile_n=64, wg_dimension=MatmulDimension.N),
               epilogue=Epilogue(activation="silu", has_bias=True))

  @parameterized.product(layout=(base.LAYOUTS[1], base.LAYOUTS[3]), k_splits=(1, 2))
  def test_sixteen_column_tiles_over_a_transposed_rhs(self, layout, k_splits):
    """128x16 CTA tiles (two 64x16 warpgroup tiles along M) over an (N, K)
    RHS, the tile an output at most 16 columns wide needs: an N of 8 under
    the 16-column tile, ragged M, 3 K steps, unsplit and in 2 ranges, the
    bias and activation applied after the ranges' sum. Each warpgroup's
    16-float bias row starts 128 bytes past the last one's, where its TMA
    copy can (with 64 bytes between them this faulted on an H100)."""
    self.check((200, 192, 8), jnp.bfloat16, seed=59, layout=layout, num_blocks=2,
               config_fields=dict(tile_n=16, epi_tile_n=16, wg_dimension=MatmulDimension.M,
                                  k_splits=k_splits),
               epilogue=Epilogue(activation="gelu", has_bias=True))

  @parameterized.product(layout_index=list(range(len(base.LAYOUTS))), k_splits=(1, 2))
  def test_rhs_transposed_first(self, layout_index, k_splits):
    """`transpose_rhs_first`: a (K, N) RHS of 12 columns is transposed by XLA
    and read in 128x16 tiles as (N, K) rows (an (N, K) RHS as stored), ragged
    M, 3 K steps, unsplit and in 2 ranges, with a bias and gelu."""
    layout = base.LAYOUTS[layout_index]
    fields = dict(transpose_rhs_first=True, tile_n=16, epi_tile_n=16,
                  wg_dimension=MatmulDimension.M, k_splits=k_splits)
    lhs, rhs = base.operands(67, 200, 192, 12, jnp.float16, layout)
    jaxpr = jax.make_jaxpr(functools.partial(
        ws_matmul, config=dataclasses.replace(SMALL_WS, **fields), layout=layout))(lhs, rhs)
    rhs_transposes = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "transpose"
                      and e.invars[0].aval.shape == (192, 12)]
    self.assertLen(rhs_transposes, 0 if layout.transpose_rhs else 1)
    self.check((200, 192, 12), jnp.float16, seed=67, layout=layout, num_blocks=2,
               config_fields=fields, epilogue=Epilogue(activation="gelu", has_bias=True))

  @parameterized.product(layout_index=list(range(len(base.LAYOUTS))), k_splits=(1, 2))
  def test_transposed_product(self, layout_index, k_splits):
    """`swap_operands`: the kernel computes out.T, here in 128x16 tiles of
    its own (the heuristic's for decode-size M), on 2 blocks; M = 12 rows
    are 12 of a 16-column tile, a ragged N = 200 is out.T's rows, 3 K steps,
    unsplit and in 2 ranges; XLA sums, transposes and applies the bias and
    activation."""
    self.check((12, 192, 200), jnp.bfloat16, seed=61, layout=base.LAYOUTS[layout_index],
               num_blocks=2, config_fields=dict(swap_operands=True, tile_n=16, epi_tile_n=16,
                                                wg_dimension=MatmulDimension.M,
                                                k_splits=k_splits),
               epilogue=Epilogue(activation="gelu", has_bias=True))

  def test_transposed_product_of_one_row(self):
    """One row (decode at batch 1) into a float32 output, with a float32 bias;
    the kernel writes out.T, its one column padded to 128 bytes."""
    config = dataclasses.replace(SMALL_WS, swap_operands=True, tile_n=16, epi_tile_n=16,
                                 wg_dimension=MatmulDimension.M)
    self.assertEqual(base.kernel_output_shapes(
        functools.partial(ws_matmul, config=config, out_dtype=jnp.float32),
        *base.operands(63, 1, 128, 136, jnp.float16)), [[(136, 32)]])
    self.check((1, 128, 136), jnp.float16, seed=63, out_dtype=jnp.float32,
               config_fields=dict(swap_operands=True, tile_n=16, epi_tile_n=16,
                                  wg_dimension=MatmulDimension.M),
               epilogue=Epilogue(activation="silu", has_bias=True))

  @parameterized.parameters(
      # (M x K x N, layout, config fields, blocks): 4 M tiles in 2 pairs, 2
      # tiles along N, on 2 clusters, each walking two pairs.
      ((256, 128, 256), base.NN, {}, 4),
      # 3 M tiles: the last pair's second block recomputes the last tile and
      # must not store it (two blocks storing one tile race); a ragged N.
      ((192, 128, 200), base.NN, {}, 2),
      # Split K: a cluster's blocks share the RHS tiles of one K range.
      ((128, 256, 128), base.NN, dict(k_splits=2), 4),
      # Operands stored transposed, ragged M, K and N.
      ((200, 80, 136), base.LAYOUTS[3], {}, 4),
      # The heuristic's use: one-segment RHS tiles of 128-column warpgroup
      # tiles, read in place at a ragged N.
      ((320, 128, 300), base.NN,
       dict(tile_n=128, rhs_tile_n=64, epi_tile_n=64, wg_dimension=MatmulDimension.M), 4),
      # A grid capped below one cluster's blocks still runs one cluster.
      ((256, 128, 128), base.NN, {}, 1),
  )
  def test_clusters_multicast_the_rhs(self, shape, layout, fields, num_blocks):
    """Two CTAs per cluster compute vertically adjacent tiles and load each RHS
    tile once for both (`TuningConfig.cluster_m`)."""
    self.check(shape, jnp.float16, seed=53, layout=layout, num_blocks=num_blocks,
               config_fields=dict(fields, cluster_m=2),
               epilogue=Epilogue(activation="gelu", has_bias=fields.get("k_splits", 1) == 1))

  @parameterized.parameters(
      (MatmulDimension.M, base.NN), (MatmulDimension.N, base.NN),
      (MatmulDimension.M, base.LAYOUTS[1]))
  def test_rhs_tiles_narrower_than_the_warpgroup_tile(self, wg_dimension, layout):
    """128-column warpgroup tiles loaded as two 64-column RHS tiles, one wgmma
    and one accumulator each (`TuningConfig.rhs_tile_n`): a (K, N) RHS with
    N = 360 is read in place as boxes; an (N, K) one is tiled along K."""
    self.check((192, 128, 360), jnp.bfloat16, seed=55, layout=layout, num_blocks=3,
               config_fields=dict(tile_n=128, rhs_tile_n=64, epi_tile_n=32,
                                  wg_dimension=wg_dimension),
               epilogue=Epilogue(activation="relu", has_bias=True))

  @parameterized.parameters(
      # (blocks, M x K x N, k_splits, epilogue, out dtype): 2 splits of 2 K
      # steps; 4 splits of one step each, 8 work items on 3 blocks; ragged
      # M and N with the bias and activation applied after the sum.
      (4, (128, 256, 128), 2, Epilogue(), jnp.bfloat16),
      (3, (128, 256, 256), 4, Epilogue(activation="silu", has_bias=True), jnp.float32),
      (4, (136, 128, 200), 2, Epilogue(activation="relu", has_bias=True), jnp.bfloat16),
      # K = 3 tile_k steps in 2 ranges of 2: the last ends a whole step
      # past K, which TMA reads as zeros (K is not padded).
      (4, (64, 192, 64), 2, Epilogue(), jnp.bfloat16),
      # K = 5 steps, the last partial, in 4 ranges of 2: the third ends in
      # the partial step, the fourth lies wholly past K.
      (3, (64, 296, 72), 4, Epilogue(activation="gelu", has_bias=True), jnp.bfloat16),
  )
  def test_split_k(self, num_blocks, shape, k_splits, epilogue, out_dtype):
    self.check(shape, jnp.bfloat16, seed=21, epilogue=epilogue, out_dtype=out_dtype,
               num_blocks=num_blocks, config_fields=dict(k_splits=k_splits))

  def test_split_k_adds_the_bias_in_float32(self):
    self.check_float32_bias(config_fields=dict(k_splits=2))

  # The heuristic's configs; 512x16384x1024 and 250x8192x4000 take its split K
  # (8 and 4 ranges); 1000x4096x3000 and 333x4096x3000 its one-segment RHS tiles in
  # clusters (333 rows: 3 M tiles, an odd count; and 2 K ranges); the last three its
  # 64-column tiles for narrow outputs (4 and 16 ranges). One case per problem, so a
  # parallel GPU run (`tools/gpu_tests.py`) spreads their compiles over its processes.
  @parameterized.parameters(
      ((4096, 4096, 4096), "none"), ((2000, 1024, 3000), "gelu"),
      ((8192, 1024, 2048), "silu"), ((1024, 2048, 1024), "relu"),
      ((512, 16384, 1024), "gelu"), ((250, 8192, 4000), "silu"),
      ((1000, 4096, 3000), "gelu"), ((333, 4096, 3000), "relu"),
      ((4096, 4096, 64), "gelu"), ((1000, 4096, 48), "silu"),
      ((7, 4096, 16), "relu"))
  def test_real_sizes_and_epilogues(self, shape, activation):
    if self.backend != testing.GPU:
      self.skipTest("real sizes run on the GPU only (minutes in the interpreter)")
    m, k, n = shape
    lhs, rhs = base.operands(8, m, k, n, jnp.bfloat16)
    bias = testing.random_array(9, (n,), jnp.bfloat16)
    out = self.run_kernel(matmul, lhs, rhs, bias, activation=activation)
    ref = matmul_reference(lhs, rhs, bias, epilogue=Epilogue(activation=activation,
                                                             has_bias=True))
    self.assert_close(out, ref, dtype=jnp.bfloat16)


def matmul_plus_addend(lhs, rhs, addend, bias=None, *, config: TuningConfig, num_blocks: int,
                       epilogue: Epilogue = Epilogue()):
  """`epilogue(lhs @ rhs + addend + bias)` through `emit_cooperative_matmul`'s addend hook."""
  def body(lhs_gmem, rhs_gmem, addend_gmem, *rest):
    *bias_gmem, out_gmem = rest
    emit_cooperative_matmul(lhs_gmem, rhs_gmem, out_gmem, *bias_gmem, config=config,
                            epilogue=epilogue, addend_gmem=addend_gmem)

  biases = () if bias is None else (bias.astype(jnp.float32),)
  return persistent_kernel(
      body, out_type=jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[1]), lhs.dtype),
      num_blocks=num_blocks, name="matmul_plus_addend")(lhs, rhs, addend, *biases)


class AddendTest(testing.KernelTestCase):
  """The epilogue's addend: loaded per sub-tile and added in float32 before the bias."""

  @parameterized.product(addend_dtype=[jnp.float32, jnp.bfloat16],
                         wg_dimension=list(MatmulDimension))
  def test_adds_the_addend(self, addend_dtype, wg_dimension):
    # 2 x 2 CTA tiles on 3 blocks: a block's second tile reads its own addend tile.
    config = dataclasses.replace(SMALL_WS, wg_dimension=wg_dimension)
    m, k, n = 2 * config.cta_tile_m, 128, 2 * config.cta_tile_n
    lhs, rhs = base.operands(31, m, k, n, jnp.bfloat16)
    addend = testing.random_array(33, (m, n), addend_dtype, scale=4.0)
    out = self.run_kernel(functools.partial(matmul_plus_addend, config=config, num_blocks=3),
                          lhs, rhs, addend)
    ref = matmul_reference(lhs, rhs) + addend.astype(jnp.float32)
    self.assert_close(out, ref, dtype=jnp.bfloat16)

  def test_addend_comes_before_bias_and_activation(self):
    config = dataclasses.replace(SMALL_WS, **base.ODD_EPILOGUE_TILINGS[0])
    m, k, n = config.cta_tile_m, 64, 2 * config.cta_tile_n
    lhs, rhs = base.operands(35, m, k, n, jnp.float16)
    addend = testing.random_array(37, (m, n), jnp.float32)
    bias = testing.random_array(39, (n,), jnp.float16)
    epilogue = Epilogue(activation="relu", has_bias=True)
    out = self.run_kernel(functools.partial(matmul_plus_addend, config=config, num_blocks=2,
                                            epilogue=epilogue), lhs, rhs, addend, bias)
    ref = epilogue.apply_to_sum(matmul_reference(lhs, rhs) + addend, bias)
    self.assert_close(out, ref, dtype=jnp.float16)

  def test_addend_must_cover_whole_tiles(self):
    lhs, rhs = base.operands(41, 96, 64, 128, jnp.float16)
    addend = jnp.zeros((96, 128), jnp.float32)
    with self.assertRaisesRegex(ValueError, "multiples of the CTA tile"):
      jax.eval_shape(functools.partial(matmul_plus_addend, config=SMALL_WS, num_blocks=1),
                     lhs, rhs, addend)


if __name__ == "__main__":
  absltest.main()
