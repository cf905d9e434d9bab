"""The fused epilogue of the warp-specialized matmuls: addend, bias, activation, cast, store.

Applied in float32 to the accumulator in registers before it is cast and
stored, so users need no separate XLA ops (and no extra pass over the output)
after the matmul. The addend, an (M, N) GMEM array added to the product
before the bias, is how a kernel built on the matmul sums partial products
(the ring reduce-scatter adds the partial its neighbour sent). The store
goes through double-buffered SMEM tiles with TMA, so the store of one
sub-tile overlaps the conversion of the next.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import barrier, smem, tma_swizzle
from pipelines.config import FP8_DTYPE, FP8_SCALE_BLOCK, NUM_COMPUTE_WGS
from pipelines.fp8_quantize import block_scales
from pipelines.operands import round_up

ACTIVATIONS = ("none", "relu", "gelu", "silu")
# The bias reaches the kernel and the split-K sum in float32, whatever its
# dtype: cast to a 16-bit output dtype first, a bias that cancels most of a
# large accumulator would overflow or lose its low bits before the addition.
BIAS_DTYPE = jnp.dtype(jnp.float32)


def checked_bias(bias: jax.Array | None, n: int) -> jax.Array | None:
  """`bias` (N,) of a real float dtype as `BIAS_DTYPE`, or None; raises,
  naming the argument, for any other shape or dtype (an integer, boolean or
  complex bias would otherwise be cast without a word)."""
  if bias is None:
    return None
  if bias.shape != (n,):
    raise ValueError(f"bias must have shape (N,)=({n},), got {bias.shape=}")
  if not jnp.issubdtype(bias.dtype, jnp.floating):
    raise ValueError(f"bias.dtype={jnp.dtype(bias.dtype).name} must be a real float dtype "
                     "(float32, bfloat16, float16, ...)")
  return bias.astype(BIAS_DTYPE)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715  # The tanh approximation's cubic coefficient.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Epilogue:
  """What happens to each output element after the K loop.

  Attributes:
    activation: "none", "relu", "gelu" (tanh approximation) or "silu".
    has_bias: whether a (N,) bias is added before the activation.
  """

  activation: str = "none"
  has_bias: bool = False

  def __post_init__(self):
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation={self.activation!r} must be one of {ACTIVATIONS}")

  def apply(self, x: jax.Array) -> jax.Array:
    """The activation on float32 values (in a kernel or in the reference)."""
    match self.activation:
      case "relu":
        return jnp.maximum(x, 0.0)
      case "gelu":
        return 0.5 * x * (1.0 + _gelu_tanh(x))
      case "silu":
        return x / (1.0 + jnp.exp(-x))
    return x

  def derivative(self, x: jax.Array) -> jax.Array:
    """d activation / dx at the float32 pre-activation `x`."""
    return self.apply_and_derivative(x)[1]

  def apply_and_derivative(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(activation, its derivative) at the float32 pre-activation `x`, in a
    kernel or outside one; the two share gelu's tanh and silu's sigmoid, so
    an epilogue that writes both pays for one."""
    match self.activation:
      case "relu":
        return jnp.maximum(x, 0.0), (x > 0).astype(jnp.float32)
      case "gelu":
        tanh = _gelu_tanh(x)
        d_inner = _SQRT_2_OVER_PI * (1.0 + 3 * _GELU_CUBIC * x * x)
        half_x = 0.5 * x
        return (half_x * (1.0 + tanh),
                0.5 * (1.0 + tanh) + half_x * (1.0 - tanh * tanh) * d_inner)
      case "silu":
        sigmoid = 1.0 / (1.0 + jnp.exp(-x))
        return x * sigmoid, sigmoid * (1.0 + x * (1.0 - sigmoid))
    return x, jnp.ones_like(x)

  def second_derivative(self, x: jax.Array) -> jax.Array:
    """d^2 activation / dx^2 at the float32 pre-activation `x` (outside a
    kernel): what a second differentiation of a kept derivative needs."""
    # Elementwise, so one forward-mode pass with unit tangents is the
    # diagonal of the Jacobian.
    return jax.jvp(self.derivative, (x,), (jnp.ones_like(x),))[1]

  @property
  def keeps_derivative(self) -> bool:
    """Whether a differentiated forward keeps the activation's derivative
    (written by its epilogue, `store_epilogue`'s `wg_derivative`): gelu's
    and silu's need the pre-activation, which the output does not give
    back; relu's is read off the output's sign and "none" has none."""
    return self.activation in ("gelu", "silu")

  def sum_cotangent(self, out_cotangent: jax.Array, saved: jax.Array | None) -> jax.Array:
    """The float32 cotangent of the sum before the activation, from the output's.

    `saved` is what the differentiated forward kept: the activation's
    derivative for gelu and silu (`keeps_derivative`), the output for relu
    (its derivative is read off the sign), None for "none". So the backward's
    elementwise work is one multiply, which XLA fuses with the bias's row
    sum into one pass (computing gelu's derivative there took two).
    """
    g = out_cotangent.astype(jnp.float32)
    if self.activation == "relu":
      return jnp.where(saved > 0, g, 0.0)
    if self.activation != "none":
      return g * saved.astype(jnp.float32)
    return g

  def apply_to_sum(self, acc: jax.Array, bias: jax.Array | None) -> jax.Array:
    """Bias, then the activation, on a float32 (M, N) sum outside a kernel.

    Args:
      acc: (M, N) float32; bias: (N,) of any float dtype, or None.
    """
    if bias is not None:
      acc = acc + bias.astype(jnp.float32)
    return self.apply(acc)


def derivative_dtype(out_dtype) -> jnp.dtype:
  """The dtype a kept derivative (`Epilogue.keeps_derivative`) is written in,
  for an output of `out_dtype`: float32 for float32, else float16. gelu's and
  silu's derivatives lie in [-0.2, 1.2], where float16 keeps three more bits
  than bfloat16 in the same bytes: a bfloat16 derivative made the gradients
  of a bf16 layer measurably less accurate than the kept pre-activation did;
  a float16 one does not (docs/performance-log.md, "The kept derivative: its dtype")."""
  return jnp.dtype(jnp.float32 if jnp.dtype(out_dtype) == jnp.float32 else jnp.float16)


def derivative_words(derivative: jax.Array, out_dtype) -> jax.Array:
  """A float32 derivative as the kernel writes it beside an output of
  `out_dtype`: in `derivative_dtype`, as words of `out_dtype`. The epilogue
  stages it through the output's SMEM tiles, so a float16 derivative of a
  bfloat16 output travels as bfloat16 words of the same bits
  (`kept_derivative` turns them back)."""
  kept = derivative.astype(derivative_dtype(out_dtype))
  out_dtype = jnp.dtype(out_dtype)
  return kept if kept.dtype == out_dtype else lax.bitcast_convert_type(kept, out_dtype)


def kept_derivative(words: jax.Array, out_dtype) -> jax.Array:
  """The derivative a kernel wrote as `derivative_words` (a bitcast, no copy)."""
  dtype = derivative_dtype(out_dtype)
  return words if words.dtype == dtype else lax.bitcast_convert_type(words, dtype)


def _gelu_tanh(x: jax.Array) -> jax.Array:
  # The tanh approximation's tanh, written out (not jax.nn.gelu) so the
  # kernel and the reference use the same formula, built only from ops
  # Mosaic GPU lowers.
  return jnp.tanh(_SQRT_2_OVER_PI * (x + _GELU_CUBIC * x * x * x))


def output_swizzle(config, out_gmem) -> int:
  """The swizzle (bytes) of the staging tiles that TMA stores into `out_gmem`:
  the widest the epilogue tile and the output's minor dimension allow."""
  return tma_swizzle((config.epi_tile_n,), (out_gmem.shape[-1],), out_gmem.dtype)


def epilogue_scratch(config, out_dtype, *, has_bias: bool, swizzle: int | None = None,
                     partial_rows: bool = False, has_column_scales: bool = False) -> dict:
  """The SMEM `store_epilogue` uses, for `pl.run_scoped(**...)` in a kernel.

  `out_smem`: (2, config.epilogue_slots, epi_tile_m, epi_tile_n) staging
  tiles of `out_dtype`, swizzled (`swizzle` bytes, `output_swizzle`; by
  default the widest a row allows); with `has_bias` also `bias_smem`
  (2, `column_vector_width`) of `BIAS_DTYPE` and `bias_loaded`, one barrier per compute
  warpgroup for the copy of its tile's bias into `bias_smem` (`column_vector_row`);
  with `has_column_scales` likewise `column_scales_smem` and `column_scales_loaded`;
  with `partial_rows` also `rows_smem`, (2, epi_tile_m, `partial_rows_width`) plain
  (unswizzled) staging tiles for the sub-tiles of which only some rows are stored
  (`store_epilogue`'s `row_range`). With an e4m3 `out_dtype` (the output quantized in the
  epilogue, `store_epilogue`'s `wg_out_scales`) also `out_scales_smem`, (2,
  config.epilogue_slots, 1, epi_tile_m) float32 staging rows of each
  sub-tile's scales.
  """
  scratch = dict(out_smem=smem((NUM_COMPUTE_WGS, config.epilogue_slots, config.epi_tile_m,
                                config.epi_tile_n), out_dtype, swizzled=True, swizzle=swizzle))
  if jnp.dtype(out_dtype) == FP8_DTYPE:
    scratch["out_scales_smem"] = smem((NUM_COMPUTE_WGS, config.epilogue_slots, 1,
                                       config.epi_tile_m), jnp.float32)
  vector_shape = (NUM_COMPUTE_WGS, column_vector_width(config))
  if has_bias:
    scratch["bias_smem"] = smem(vector_shape, BIAS_DTYPE)
    scratch["bias_loaded"] = barrier(num_barriers=NUM_COMPUTE_WGS)
  if has_column_scales:
    scratch["column_scales_smem"] = smem(vector_shape, jnp.float32)
    scratch["column_scales_loaded"] = barrier(num_barriers=NUM_COMPUTE_WGS)
  if partial_rows:
    scratch["rows_smem"] = smem((NUM_COMPUTE_WGS, config.epi_tile_m,
                                 partial_rows_width(config, out_dtype)), out_dtype)
  return scratch


# Where the SMEM side of a TMA copy must start: on a multiple of this many
# bytes. An SMEM ref that several copies fill or read by rows needs rows of a
# multiple of it (rows of 64 bytes fault with a misaligned address on the GPU;
# the interpreter does not check it).
TMA_SMEM_ALIGNMENT_BYTES = 128
# The bytes of a row of `rows_smem`: the partial sub-tiles go out in column
# chunks this wide. A whole epilogue tile (256 bytes a row for a 16-bit
# 64x128 one) would take 8 KiB more SMEM per warpgroup, which a grouped
# 128x256 tile needs for its third pipeline stage; the chunks cost only the
# rare sub-tiles at a group's edges a few more waits. Not narrower: the
# ladder's boxes start at any row.
PARTIAL_ROWS_BYTES = TMA_SMEM_ALIGNMENT_BYTES


def column_vector_width(config) -> int:
  """The columns of each warpgroup's row of `bias_smem` and
  `column_scales_smem` (float32): `config.tile_n`, rounded up to whole
  `TMA_SMEM_ALIGNMENT_BYTES`, so that the second warpgroup's row, which a TMA
  copy fills, starts on them. With 16-column tiles the rows of 64 bytes
  faulted with a misaligned address on an H100."""
  return round_up(config.tile_n, TMA_SMEM_ALIGNMENT_BYTES // jnp.dtype(jnp.float32).itemsize)


def column_vector_row(vector_smem, wg, config):
  """Warpgroup `wg`'s `config.tile_n` columns of `bias_smem` or
  `column_scales_smem` (`column_vector_width`), the destination of its copy."""
  return vector_smem.at[wg, pl.ds(0, config.tile_n)]


def partial_rows_width(config, out_dtype) -> int:
  """The columns of `epilogue_scratch`'s `rows_smem`: `PARTIAL_ROWS_BYTES` of
  `out_dtype` (the grouped matmul's configs have epilogue tiles a multiple
  of that wide: `kernel_call.check_ws_config`)."""
  return min(config.epi_tile_n, PARTIAL_ROWS_BYTES // jnp.dtype(out_dtype).itemsize)


def _store_rows(x, first: jax.Array, end: jax.Array, rows_smem, gmem_tile) -> None:
  """Stores rows [first, end) of the sub-tile `x` (traced, 0 <= first < end
  <= x.shape[0], not all of them) into the same rows of `gmem_tile`, leaving
  its other rows untouched.

  A TMA store writes a whole box of static shape, so the rows go out as a
  ladder of boxes of 2^j rows, one for each bit set in their count (13 rows:
  8, then 4, then 1). The boxes start at any row, which a swizzled tile
  cannot be sliced at (it is copied in tiles of 8 rows), so `x` is staged in
  a plain tile (`rows_smem`), `rows_smem.shape[1]` columns at a time:
  slower to write, but only the sub-tiles at a group's edges take this path.
  """
  width = rows_smem.shape[1]
  count = end - first
  for c in range(x.shape[1] // width):
    columns = pl.ds(c * width, width)
    # The previous ladder must be done reading `rows_smem`.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    rows_smem[...] = x[:, c * width:(c + 1) * width].astype(rows_smem.dtype)
    plgpu.commit_smem()
    start, size = first, x.shape[0] // 2
    while size:
      @pl.when(count & size != 0)
      def _store(size=size, start=start, columns=columns):
        plgpu.copy_smem_to_gmem(rows_smem.at[pl.ds(start, size)],
                                gmem_tile.at[pl.ds(start, size), columns])
      start = start + (count & size)
      size //= 2


def store_epilogue(acc_blocks, wg, wg_out, out_smem, bias_smem, config, epilogue: Epilogue,
                   wg_addend=None, wg_pre_activation=None, up_blocks=None,
                   wg_up_product=None, row_range=None, rows_smem=None,
                   wg_derivative=None, column_scales_smem=None, wg_out_scales=None,
                   out_scales_smem=None) -> None:
  """Applies `epilogue` to a compute warpgroup's accumulator and stores it with TMA.

  Runs in compute warpgroup `wg` of a matmul kernel, after its K loop.

  Args:
    acc_blocks: the (config.tile_m, config.tile_n) float32 accumulator value,
      as a sequence of column blocks of equal width, each a multiple of
      config.epi_tile_n (one per RHS tile, `TuningConfig.rhs_tiles_per_wg`).
    wg: the warpgroup's index; it owns `out_smem[wg]` and `bias_smem[wg]`.
    wg_out: (tile_m, tile_n) GMEM ref of the output (TMA masks ragged edges).
    out_smem: (2, config.epilogue_slots, epi_tile_m, epi_tile_n) SMEM staging
      tiles of the output dtype, swizzled.
    bias_smem: (2, `column_vector_width(config)`) float32 SMEM ref whose
      first tile_n columns hold this tile's bias (loaded), or None.
    column_scales_smem: the same shape of SMEM ref, holding the scale of
      each of this tile's columns (loaded), or None: the accumulator is
      multiplied by it before anything is added (the dequantization of an
      FP8 product).
    config: a `TuningConfig` (tiles and epilogue tiles).
    wg_addend: (tile_m, tile_n) GMEM ref of any float dtype, added in float32
      before the bias, or None. Each epilogue sub-tile of it is loaded
      straight into registers in the accumulator's layout, so it takes no
      SMEM; it must lie wholly in bounds (plain loads are not masked as TMA
      stores are), and the caller makes sure it is written before this runs.
    wg_pre_activation: (tile_m, tile_n) GMEM ref of the output's dtype, or
      None: receives the pre-activation (the sum before the activation), for
      a backward pass that needs it. Each sub-tile's pre-activation goes
      through the same staging slots just before its output, so it costs
      one more TMA store per sub-tile and no SMEM.
    up_blocks: for a gated unit, the up projection's accumulator, split as
      `acc_blocks` is: the output is then `activation(acc + bias) * up`.
      None otherwise.
    wg_up_product: (tile_m, tile_n) GMEM ref of the output's dtype, or None:
      receives the up projection (for a backward pass), as
      `wg_pre_activation` receives the gate's pre-activation.
    wg_derivative: (tile_m, tile_n) GMEM ref of the output's dtype, or None:
      receives the activation's derivative at the pre-activation (for a
      backward pass: `Epilogue.keeps_derivative`), computed with the
      activation (`Epilogue.apply_and_derivative`) and stored through the
      same staging slots just before the output, as `derivative_words`.
    row_range: the rows [first, end) of the tile to store (traced int32, 0
      <= first <= end <= tile_m), or None for all (TMA still masks those
      past the array). The other rows belong to someone else (a grouped
      matmul's other groups), so they are not written at all: the sub-tiles
      that hold some of each go out through `rows_smem` (`epilogue_scratch`'s,
      this warpgroup's), and those with none of the range are skipped.
    wg_out_scales: for an e4m3 output quantized here, the (tile_n / 128,
      tile_m) float32 GMEM ref of the tile's scales, stored transposed (one
      row per 128 columns; `out_smem` is then e4m3 and the epilogue tiles are
      128 columns wide): each sub-tile row's 128 values are divided by their
      scale, their largest magnitude over e4m3's largest value
      (`fp8_quantize.block_scales`, as `quantize_fp8` has it), and stored
      with it. None otherwise.
    out_scales_smem: `epilogue_scratch`'s staging rows for those scales.
  """
  epi_m, epi_n = config.epi_tile_m, config.epi_tile_n
  n_sub = config.tile_n // epi_n
  block_n = config.tile_n // len(acc_blocks)
  slots = config.epilogue_slots
  stores_per_sub_tile = 1 + sum(gmem is not None for gmem in (wg_pre_activation, wg_up_product,
                                                               wg_derivative, wg_out_scales))
  num_stores = (config.tile_m // epi_m) * n_sub * stores_per_sub_tile
  store = 0

  def stage_and_store(x, gmem_tile, sub_tile_rows=None):
    nonlocal store
    if sub_tile_rows is not None:
      # Whole sub-tiles take the swizzled slots; one with some of its rows
      # the ladder; one with none nothing. A skipped store leaves fewer
      # stores in flight than the slot count assumes, which only makes the
      # wait before reusing a slot stricter.
      first, end = sub_tile_rows
      whole = (first == 0) & (end == epi_m)

      @pl.when(whole)
      def _whole():
        stage_and_store(x, gmem_tile)

      @pl.when((end > first) & ~whole)
      def _partial():
        _store_rows(x, first, end, rows_smem.at[wg], gmem_tile)
      return
    slot = store % slots
    # Before writing a slot, wait for the store that last read it. Within a
    # tile that is the store `slots` back, so all but the last `slots - 1`
    # stores must be done. A tile's first store meets the previous tile's
    # stores instead: they used the slots in the same order only when each
    # tile makes a multiple of `slots` stores; otherwise (say 3 sub-tiles
    # in 2 slots) the previous tile's last store may still be reading this
    # slot, so wait for all of them. They were issued before this tile's K
    # loop, so that wait costs nothing.
    in_flight = 0 if store == 0 and num_stores % slots else slots - 1
    plgpu.wait_smem_to_gmem(in_flight, wait_read_only=True)
    if x.ndim == 1:
      # A quantized sub-tile's scales (`wg_out_scales`): their own staging
      # row. Counted as a store, so its slot is reused only once the store
      # that last read it is done, as for the tiles.
      staging = out_scales_smem.at[wg, slot]
      staging[0, :] = x
    else:
      staging = out_smem.at[wg, slot]
      staging[...] = x.astype(out_smem.dtype)
    plgpu.commit_smem()  # Register stores must be visible to the TMA engine.
    plgpu.copy_smem_to_gmem(staging, gmem_tile)
    store += 1

  def by_column(vector_smem, j, shape):
    """Sub-tile column `j`'s part of a per-column vector in SMEM (one row per
    warpgroup, `column_vector_width`), broadcast along the rows of a sub-tile."""
    vector = plgpu.load(vector_smem.at[wg, pl.ds(j * epi_n, epi_n)],
                        layout=plgpu.Layout.WGMMA.reduce(0))
    return lax.broadcast_in_dim(vector, shape, (1,))

  for i in range(config.tile_m // epi_m):
    sub_tile_rows = None if row_range is None else tuple(
        jnp.clip(bound - i * epi_m, 0, epi_m) for bound in row_range)
    for j in range(n_sub):
      block, col = divmod(j * epi_n, block_n)
      x = acc_blocks[block][i * epi_m:(i + 1) * epi_m, col:col + epi_n]
      if column_scales_smem is not None:
        x = x * by_column(column_scales_smem, j, x.shape)
      if wg_addend is not None:
        # Straight from GMEM into the accumulator's layout: each thread loads
        # its pairs of adjacent elements. Mosaic GPU's "optimized" transfers
        # exist for SMEM only, hence optimized=False.
        addend = plgpu.load(wg_addend.at[pl.ds(i * epi_m, epi_m), pl.ds(j * epi_n, epi_n)],
                            layout=plgpu.Layout.WGMMA, optimized=False)
        x = x + addend.astype(jnp.float32)
      if bias_smem is not None:
        x = x + by_column(bias_smem, j, x.shape)
      sub_tile = (pl.ds(i * epi_m, epi_m), pl.ds(j * epi_n, epi_n))
      if wg_pre_activation is not None:
        stage_and_store(x, wg_pre_activation.at[sub_tile], sub_tile_rows)
      if wg_derivative is not None:
        x, derivative = epilogue.apply_and_derivative(x)
        stage_and_store(derivative_words(derivative, out_smem.dtype),
                        wg_derivative.at[sub_tile], sub_tile_rows)
      else:
        x = epilogue.apply(x)
      if up_blocks is not None:
        up = up_blocks[block][i * epi_m:(i + 1) * epi_m, col:col + epi_n]
        if wg_up_product is not None:
          stage_and_store(up, wg_up_product.at[sub_tile], sub_tile_rows)
        x = x * up
      if wg_out_scales is not None:
        scales = block_scales(jnp.max(jnp.abs(x), axis=1))
        x = x / lax.broadcast_in_dim(scales, x.shape, (0,))
        stage_and_store(scales, wg_out_scales.at[pl.ds(j * epi_n // FP8_SCALE_BLOCK, 1),
                                                 pl.ds(i * epi_m, epi_m)])
      stage_and_store(x, wg_out.at[sub_tile], sub_tile_rows)
