"""The cooperative schedule of the warp-specialized persistent matmul (sm_90): the kernel body.

Both compute warpgroups of a block work on one CTA tile, each accumulating
its (tile_m, tile_n) half along `config.wg_dimension` with wgmma, while the
memory warpgroup (`plgpu.emit_pipeline_warp_specialized`) keeps
`max_concurrent_steps` SMEM slots of operand tiles in flight with TMA. Then
both run the fused epilogue (`epilogue.store_epilogue`). Grid, thread axes
and tile order: `persistent_sm90`. Where the warpgroups split N, each one's
RHS tile is a buffer of its own (`TuningConfig.rhs_tiles`), so a 64-column
one is one swizzle segment, which TMA copies as a box at a ragged N.

With `config.k_splits` > 1 (split-K, for outputs with too few tiles to
occupy the SMs) the work items are (K range, output tile) pairs and the
kernel stores float32 partial tiles; the wrapper (`kernel_call.ws_matmul`)
sums them. With `config.rhs_tile_n` each warpgroup's RHS columns are several
tiles, one wgmma and accumulator each; with `config.cluster_m` = 2 the two
blocks of a cluster compute vertically adjacent tiles and TMA multicasts
each RHS tile to both.

`emit_cooperative_matmul` is also a building block: the ring all-gather
matmul calls it inside its own kernel and hooks into the pipeline with
`pipeline_callback` and `delay_release`; the ring reduce-scatter matmul adds
the partial product it received in the epilogue (`addend_gmem`) and stores
the sum to a peer's memory (an `out_gmem` made by `plgpu.remote_ref`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import accumulator, barrier, tile_transforms
from pipelines.config import (
  FP8_DTYPE,
  FP8_SCALE_BLOCK,
  NUM_COMPUTE_WGS,
  MatmulDimension,
  Schedule,
  TuningConfig,
  operand_swizzle,
)
from pipelines.epilogue import (
  Epilogue,
  column_vector_row,
  epilogue_scratch,
  output_swizzle,
  store_epilogue,
)
from pipelines.group_schedule import ROW_ALIGNMENT, GroupRows, GroupTiles
from pipelines.operands import NN, OperandLayout
from pipelines.persistent_sm90 import (
  CLUSTER_AXIS,
  MEMORY_WG_REGISTERS,
  WG_AXIS,
  for_each_work_item,
)

# pipeline_callback(m_tile, n_tile, k_step, lhs_smem): runs in each compute
# warpgroup after it issued the step's wgmma.
PipelineCallback = Callable[[jax.Array, jax.Array, jax.Array, object], None]


def pipeline_buffer_names(config: TuningConfig, *, gated: bool = False) -> tuple[str, ...]:
  """The operand pipeline's SMEM buffers, in the order of its in_specs (with
  `gated`, the gate's RHS tiles, then the up projection's)."""
  rhs_names = ("gate_smem", "up_smem") if gated else ("rhs_smem",)
  if config.rhs_tiles == 1:
    return ("lhs_smem", *rhs_names)
  return ("lhs_smem", *(f"{name}[{j}]" for name in rhs_names for j in range(config.rhs_tiles)))


def _operand_pipeline(config: TuningConfig, dtype, k_steps, delay_release: int,
                      layout: OperandLayout, step, compute_context, swizzle: int | None,
                      num_rhs: int = 1, k_start=None, chained: bool = False):
  """The memory warpgroup's pipeline of LHS and RHS tiles, as the operands are stored:
  (cta_m, tile_k) or (tile_k, cta_m), and `config.rhs_tiles` RHS tiles of
  (tile_k, rhs_tile_width) or (rhs_tile_width, tile_k) for each of `num_rhs`
  RHS operands (2 for a gated unit's gate and up projection), all with
  `swizzle` (`config.operand_swizzle`). With `config.cluster_m` = 2 the RHS
  tiles are multicast to both blocks of the cluster.

  With `k_start` (a traced row, a multiple of `ROW_ALIGNMENT`; for a (K, M)
  LHS and a (K, N) RHS only), step kk reads the K rows from `k_start + kk *
  tile_k` of operands that hold all K rows, and `k_steps` may be traced:
  a grouped matmul's ragged K.

  With `chained` (`_chains_tiles`), consecutive calls share one ring of slots:
  the memory warpgroup waits for each slot's release, the first call's
  included (`_release_all_slots` makes those), and never for the last
  call's releases."""
  def spec(block_shape, index_map, collective_axes=None):
    return plgpu.BlockSpec(block_shape, index_map,
                           transforms=tile_transforms(block_shape[-1], dtype, swizzle=swizzle),
                           delay_release=delay_release, collective_axes=collective_axes)
  width = config.rhs_tile_width
  rhs_axes = (CLUSTER_AXIS,) if config.cluster_m > 1 else None
  if k_start is not None:
    k_block = pl.Element(config.tile_k)

    def k_row(kk):
      return pl.multiple_of(k_start + kk * config.tile_k, ROW_ALIGNMENT)
    lhs_spec = spec((k_block, config.cta_tile_m), lambda kk: (k_row(kk), 0))
    rhs_specs = [spec((k_block, width), lambda kk, j=j: (k_row(kk), j))
                 for j in range(config.rhs_tiles)]
  else:
    if layout.transpose_lhs:
      lhs_spec = spec((config.tile_k, config.cta_tile_m), lambda kk: (kk, 0))
    else:
      lhs_spec = spec((config.cta_tile_m, config.tile_k), lambda kk: (0, kk))
    if layout.transpose_rhs:
      rhs_specs = [spec((width, config.tile_k), lambda kk, j=j: (j, kk), rhs_axes)
                   for j in range(config.rhs_tiles)]
    else:
      rhs_specs = [spec((config.tile_k, width), lambda kk, j=j: (kk, j), rhs_axes)
                   for j in range(config.rhs_tiles)]
  return plgpu.emit_pipeline_warp_specialized(
      step,
      grid=(k_steps,),
      memory_registers=MEMORY_WG_REGISTERS,
      in_specs=[lhs_spec, *rhs_specs * num_rhs],
      wg_axis=WG_AXIS,
      num_compute_wgs=NUM_COMPUTE_WGS,
      max_concurrent_steps=config.max_concurrent_steps,
      compute_context=compute_context,
      # Every call in the middle of the chain: no prologue that assumes free
      # slots, and no wait at the end for the last steps' releases.
      pipeline_state=plgpu.PipelinePipeline.STEADY if chained else None,
  )


def _chains_tiles(config: TuningConfig, k_steps: int, *, delay_release: int,
                 ragged_k: bool) -> bool:
  """Whether a block's tiles run their K loops on one ring of operand slots
  (`TuningConfig.chain_tiles`).

  The slot of K step kk is kk % max_concurrent_steps in each tile's
  pipeline, so the ring lines up across tiles only when a tile's K steps
  are a multiple of the slots. A ragged K's length is traced (a chained
  pipeline must be static), and a pipeline callback holds slots past their
  step (`delay_release`). A grouped matmul's tiles that skip their K loop
  (no rows, or only rows past the groups) skip it in every warpgroup, so the
  ring carries on with the next tile that runs one; and the blocks of a
  cluster run the same tiles' worth of K steps in step
  (`for_each_work_item`), so their shared slots chain alike.
  """
  return (config.chain_tiles and not (ragged_k or delay_release)
          and k_steps % config.max_concurrent_steps == 0)


def _release_all_slots(pipeline_allocs, config: TuningConfig) -> None:
  """Releases every slot of a chained operand pipeline once, before the
  first tile: its memory warpgroup then finds them free, as a chain's first
  call would otherwise assume by skipping its waits. Runs in each compute
  warpgroup, which are the releases each slot's barrier counts."""
  [consumed] = pipeline_allocs["flat_consumed_barrier_refs"]
  for slot in range(config.max_concurrent_steps):
    plgpu.barrier_arrive(consumed.at[slot])


def _await_last_releases(pipeline_allocs, config: TuningConfig) -> None:
  """Waits, after a block's last tile, for the releases of a chained operand
  pipeline's slots that no load waited for: the last tile's last K steps, or
  `_release_all_slots`'s where the block had no tile. Runs in the memory
  warpgroup, which must observe every phase of the barriers it waits on
  before they are freed."""
  [consumed] = pipeline_allocs["flat_consumed_barrier_refs"]
  for slot in range(config.max_concurrent_steps):
    plgpu.barrier_wait(consumed.at[slot])


def _zero_rows_of_other_groups(lhs_smem, first_row, start, end) -> None:
  """Zeroes the rows of a (tile_k, tile_m) SMEM tile of LHS rows [first_row,
  first_row + tile_k) that lie outside the group's [start, end), if any.

  Runs in a compute warpgroup on the columns only it reads, before its
  wgmma, so no other warpgroup needs to wait for it."""
  tile_k = lhs_smem.shape[0]

  @pl.when((first_row < start) | (first_row + tile_k > end))
  def _zero():
    row = first_row + plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, lhs_smem.shape, 0),
                                        plgpu.Layout.WGMMA)
    tile = plgpu.load(lhs_smem, layout=plgpu.Layout.WGMMA)
    lhs_smem[...] = jnp.where((row >= start) & (row < end), tile, jnp.zeros_like(tile))
    plgpu.commit_smem()  # The wgmma reads SMEM through the async proxy.


def cooperative_scratch(config: TuningConfig, dtype, out_dtype, *, k: int, has_bias: bool,
                        delay_release: int = 0, layout: OperandLayout = NN,
                        swizzle: int | None = None, out_swizzle: int | None = None,
                        gated: bool = False, grouped: bool = False,
                        ragged_k: bool = False, has_column_scales: bool = False) -> dict:
  """The SMEM `emit_cooperative_matmul` allocates for K = `k`, by name.

  The kernel allocates exactly this (`pl.run_scoped(**...)`), and
  `kernel_call.ws_smem_budget` sums it, so the budget cannot drift from the
  allocation. "pipeline_allocs" is the operand pipeline's own declaration
  (its slots and barriers, from `get_allocations`, which needs only shapes).
  `swizzle` and `out_swizzle` (bytes) lay out the operand and output tiles;
  by default the widest their rows allow (sizes do not depend on them).
  `gated`: the pipeline carries a second RHS (`emit_cooperative_matmul`'s
  `up_gmem`). `grouped`: the epilogue stores tiles of any number of rows
  (`emit_cooperative_matmul`'s `group_tiles`). `ragged_k`: the K loop's
  length is traced (`emit_cooperative_matmul`'s `group_rows`), so the
  pipeline keeps all its slots whatever `k` is. `has_column_scales`: the
  epilogue scales the columns (`emit_cooperative_matmul`'s `column_scales_gmem`).
  """
  num_rhs = 2 if gated else 1
  k_steps = config.split_k_steps(k)
  if ragged_k:
    # A static K loop shorter than the pipeline allocates fewer slots.
    k_steps = max(k_steps, config.max_concurrent_steps)

  def ignore(*_, **__):
    return None

  shapes = (jax.ShapeDtypeStruct(layout.lhs_shape(config.cta_tile_m, k), dtype),
            *[jax.ShapeDtypeStruct(layout.rhs_shape(k, config.cta_tile_n), dtype)]
            * (config.rhs_tiles * num_rhs))
  scratch = dict(
      pipeline_allocs=_operand_pipeline(config, dtype, k_steps, delay_release, layout, ignore,
                                        ignore, swizzle, num_rhs).get_allocations(*shapes),
      **epilogue_scratch(config, config.store_dtype(out_dtype),
                         has_bias=has_bias and config.fuses_epilogue, swizzle=out_swizzle,
                         partial_rows=grouped, has_column_scales=has_column_scales),
  )
  if delay_release:
    # The pipeline never waits for the release of a tile's last
    # `delay_release` steps, so the memory warpgroup could refill those slots
    # for the next tile while a wgmma or a callback's copy still reads them.
    # The compute warpgroups arrive here once they are done with every slot.
    scratch["tile_drained"] = barrier(num_arrivals=NUM_COMPUTE_WGS)
  return scratch


def emit_cooperative_matmul(lhs_gmem, rhs_gmem, out_gmem, bias_gmem=None, *,
                            config: TuningConfig, epilogue: Epilogue = Epilogue(),
                            pipeline_callback: PipelineCallback | None = None,
                            delay_release: int = 0, layout: OperandLayout = NN,
                            addend_gmem=None, pre_activation_gmem=None, up_gmem=None,
                            up_product_gmem=None, group_tiles: GroupTiles | None = None,
                            group_rows: GroupRows | None = None,
                            derivative_gmem=None, column_scales_gmem=None,
                            out_scales_gmem=None) -> None:
  """Emits `out_gmem = epilogue(lhs_gmem @ rhs_gmem + addend_gmem + bias_gmem)` inside a kernel.

  With `up_gmem`, the gated unit instead: `out_gmem = epilogue(lhs_gmem @
  rhs_gmem + bias_gmem) * (lhs_gmem @ up_gmem)`, each LHS tile loaded once
  for both products, each warpgroup holding an accumulator for each.

  Must be called from a kernel built by `kernel_call.persistent_kernel`
  (grid axis `SM_AXIS`, three threads on `WG_AXIS`, clusters of
  `config.cluster_m` blocks on `CLUSTER_AXIS`). All shapes are static.
  M, N and K may be ragged: TMA masks the edge tiles and fills a partial last
  K step with zeros. But each array's major dimension must be a multiple of
  8 and its minor one of 32 bytes (the tiles take the widest swizzle the
  minor dimensions allow, `config.operand_swizzle`), a minor M or N at least the
  CTA tile's (`operands.tma_sizes`), except for arrays whose tiles are one
  swizzle segment wide, which are copied as 2D boxes and need only rows on
  16 bytes (`core.tma_copies_in_place`). K is the LHS's; the
  RHS may hold more or fewer rows of K (padded or not), since what lies past
  either array's end reads as zeros. `kernel_call.check_ws_config` checks
  the config.

  Args:
    lhs_gmem: (M, K) ref, or (K, M) with `layout.transpose_lhs`.
    rhs_gmem: (K, N) ref, or (N, K) with `layout.transpose_rhs`.
    out_gmem: (M, N) ref; with `config.k_splits` > 1, a (k_splits, M, N)
      float32 ref that receives each K range's partial product (the
      epilogue must then be the identity and `bias_gmem` None: the caller
      applies them to the sum).
    bias_gmem: (N,) float32 ref, or None.
    config: a `TuningConfig` with the cooperative schedule.
    pipeline_callback: see `PipelineCallback`; with it, `delay_release` keeps
      each step's SMEM slots alive that many extra steps, for async reads of
      them the callback started (it must finish them by then). Its SMEM tiles
      are laid out as the operands are stored.
    layout: how lhs_gmem and rhs_gmem are stored; transposed operands are
      loaded as stored and handed to wgmma as transposed SMEM views.
    addend_gmem: (M, N) ref of any float dtype, or None: added in float32 to
      the product before the bias and activation (`epilogue.store_epilogue`
      loads it per epilogue sub-tile, without SMEM). M and N must then be
      multiples of the CTA tile, since those loads are not masked. The
      caller makes sure it is written before the epilogue reads it.
    pre_activation_gmem: (M, N) ref of `out_gmem`'s dtype, or None: also
      receives the sum before the activation (for a gated unit's backward
      pass).
    up_gmem: the up projection's RHS, of `rhs_gmem`'s shape and layout, or
      None. Both may be views of one fused weight (see
      `kernel_call.ws_gated_matmul`).
    up_product_gmem: (M, N) ref of `out_gmem`'s dtype, or None: also receives
      `lhs_gmem @ up_gmem` (for a backward pass).
    group_tiles: for a grouped matmul (`ragged_dot`), its row tiles
      (`group_schedule.group_tiles` for tile_m = `config.cta_tile_m`) as
      (T,) int32 GMEM refs, or None. `rhs_gmem` then holds G weights, (G, K,
      N) or (G, N, K), and the work items are (entry, N tile): entry t
      multiplies the `rows[t]` rows from `row_start[t]` by weight
      `group[t]`, stores only those rows, and stores zeros for group G (the
      rows past the groups). Needs cluster_m = 1 and k_splits = 1.
    group_rows: for a grouped matmul's weight gradient (a ragged K), each
      group's rows (`group_schedule.group_rows`) as (G,) int32 GMEM refs, or
      None. Then lhs_gmem is (K, M) (`layout.transpose_lhs`), rhs_gmem (K,
      N), out_gmem (G, M, N), and `out_gmem[g] = lhs_gmem[rows of g].T @
      rhs_gmem[rows of g]`, zeros for an empty group: the work items are
      (group, output tile), each with a K loop over its group's rows only.
      Its first and last steps read rows of other groups (the loop starts
      on 8 rows, as tiled copies need, and ends on a whole step), which each
      compute warpgroup zeroes in its LHS columns before its wgmma; the RHS
      rows are read as they are, so a non-finite value in one group's rows
      of the RHS makes NaNs in a neighbour's gradient. Needs the layout TN,
      `config.wg_dimension` M, cluster_m = 1, k_splits = 1, and no bias,
      epilogue, gate or extra outputs.
    derivative_gmem: (M, N) ref of `out_gmem`'s dtype, or None: also
      receives the activation's derivative at the sum (for a backward pass:
      `Epilogue.keeps_derivative`).
    column_scales_gmem: (N,) float32 ref, or None: each column of the product
      is multiplied by its scale before the addend, bias and activation (an
      FP8 product's dequantization). Needs k_splits = 1, and no gate or
      grouped matmul.
    out_scales_gmem: for an e4m3 `out_gmem` (the output quantized in the
      epilogue, one float32 scale per row and 128 columns, as `quantize_fp8`
      has them), their (N / 128, M) float32 ref, stored transposed and
      holding whole CTA tiles. Needs epilogue tiles of 128 columns,
      k_splits = 1, no cluster, and nothing else stored or fused but the
      bias, activation and column scales; None otherwise.
  """
  if config.schedule != Schedule.COOPERATIVE:
    raise ValueError(f"emit_cooperative_matmul runs the cooperative schedule; got "
                     f"{config.schedule!r}")
  k_splits = config.k_splits
  gated = up_gmem is not None
  if gated and (pipeline_callback is not None or addend_gmem is not None):
    raise ValueError("a gated unit (up_gmem) takes no pipeline_callback or addend_gmem")
  if up_product_gmem is not None and not gated:
    raise ValueError("up_product_gmem needs up_gmem")
  if gated and up_gmem.shape != rhs_gmem.shape:
    raise ValueError(f"up_gmem must have rhs_gmem's shape {rhs_gmem.shape}, got {up_gmem.shape}")
  if column_scales_gmem is not None and (k_splits > 1 or gated or group_tiles is not None
                                         or group_rows is not None):
    raise ValueError("column_scales_gmem needs k_splits=1 and no gate or grouped matmul")
  if k_splits > 1 and (bias_gmem is not None or epilogue != Epilogue()
                       or pipeline_callback is not None or addend_gmem is not None
                       or pre_activation_gmem is not None or derivative_gmem is not None
                       or gated):
    raise ValueError(f"k_splits={k_splits} stores float32 partial sums: the bias, activation, "
                     "addend, kept outputs and pipeline_callback belong to the caller")
  grouped = group_tiles is not None
  ragged_k = group_rows is not None
  quantized = out_scales_gmem is not None
  if quantized != (out_gmem.dtype == FP8_DTYPE):
    raise ValueError(f"out_scales_gmem must be given exactly for an e4m3 output; got "
                     f"{out_gmem.dtype=} and {'an' if quantized else 'no'} out_scales_gmem")
  if quantized and (config.epi_tile_n != FP8_SCALE_BLOCK or k_splits != 1
                    or config.cluster_m != 1 or grouped or ragged_k or gated
                    or pipeline_callback is not None or addend_gmem is not None
                    or pre_activation_gmem is not None or derivative_gmem is not None):
    raise ValueError(f"an output quantized in the epilogue needs epi_tile_n="
                     f"{FP8_SCALE_BLOCK}, k_splits=1, cluster_m=1 and no other output, "
                     f"addend, gate, grouped matmul or pipeline_callback; got {config!r}")
  if ragged_k and (grouped or config.cluster_m != 1 or k_splits != 1 or gated
                   or not layout.transpose_lhs or layout.transpose_rhs
                   or config.wg_dimension != MatmulDimension.M or epilogue != Epilogue()
                   or bias_gmem is not None or pipeline_callback is not None
                   or addend_gmem is not None or pre_activation_gmem is not None
                   or derivative_gmem is not None):
    raise ValueError(f"a ragged K (group_rows) needs a (K, M) LHS and a (K, N) RHS, "
                     f"wg_dimension=M, cluster_m=1, k_splits=1 and nothing else fused; got "
                     f"{config!r}, {layout=}")
  if grouped and (config.cluster_m != 1 or k_splits != 1 or gated or layout.transpose_lhs
                  or pipeline_callback is not None or addend_gmem is not None):
    raise ValueError(f"a grouped matmul (group_tiles) needs cluster_m=1, k_splits=1, an (M, K) "
                     f"LHS and no gate, pipeline_callback or addend; got {config!r}, {layout=}")
  k, m = lhs_gmem.shape if layout.transpose_lhs else lhs_gmem.shape[::-1]
  # One weight's (K, N) or (N, K), for a grouped matmul's (G, ...) stack of them.
  rhs_shape = rhs_gmem.shape[1:] if grouped else rhs_gmem.shape
  n = rhs_shape[0] if layout.transpose_rhs else rhs_shape[1]
  if addend_gmem is not None and (addend_gmem.shape != (m, n) or m % config.cta_tile_m
                                  or n % config.cta_tile_n):
    raise ValueError(f"addend_gmem must be (M, N)=({m}, {n}) with M and N multiples of the CTA "
                     f"tile ({config.cta_tile_m}, {config.cta_tile_n}); got "
                     f"{addend_gmem.shape=}")
  dtype = lhs_gmem.dtype
  tile_m, tile_n = config.tile_m, config.tile_n
  cta_m, cta_n = config.cta_tile_m, config.cta_tile_n
  # Each block's share of a tile: `k_steps` K steps from split * split_k.
  # The last range may end past K (`TuningConfig.split_k_steps`), where TMA
  # fills whole steps with zeros, as it does a partial last step.
  k_steps = config.split_k_steps(k)
  split_k = k_steps * config.tile_k
  out_m_tiles = pl.cdiv(m, cta_m)
  if grouped:
    m_tiles = group_tiles.group.shape[0]
  elif ragged_k:
    # Work item (group, output tile) is M tile group * out_m_tiles + tile:
    # blocks running at once share a group's rows in L2.
    m_tiles = group_rows.start.shape[0] * out_m_tiles
  else:
    m_tiles = out_m_tiles
  num_rhs = 2 if gated else 1
  swizzle = operand_swizzle(config, lhs_gmem, rhs_gmem.at[0] if grouped else rhs_gmem,
                            transpose_lhs=layout.transpose_lhs, transpose_rhs=layout.transpose_rhs)
  # One allocation serves every output tile, so no scoped allocation (a
  # block-wide sync) sits in the tile loop.
  scratch = cooperative_scratch(config, dtype, out_gmem.dtype, k=k,
                                has_bias=bias_gmem is not None, delay_release=delay_release,
                                layout=layout, swizzle=swizzle,
                                out_swizzle=output_swizzle(
                                    config, out_gmem.at[0] if ragged_k else out_gmem),
                                gated=gated, grouped=grouped, ragged_k=ragged_k,
                                has_column_scales=column_scales_gmem is not None)

  @functools.partial(pl.run_scoped, **scratch, collective_axes=WG_AXIS)
  def _scope(pipeline_allocs, out_smem, tile_drained=None, bias_smem=None, bias_loaded=None,
             rows_smem=None, column_scales_smem=None, column_scales_loaded=None,
             out_scales_smem=None):
    wg = lax.axis_index(WG_AXIS)
    chained = _chains_tiles(config, k_steps, delay_release=delay_release, ragged_k=ragged_k)
    if chained:
      pl.when(wg < NUM_COMPUTE_WGS)(lambda: _release_all_slots(pipeline_allocs, config))

    def work_item(split, m_tile, n_tile, _):
      # A cluster's second block past the last M tile (`for_each_work_item`)
      # runs the K loop, since the multicast loads need both blocks, on LHS
      # rows that TMA fills with zeros, and stores nothing.
      stores = m_tile < m_tiles if config.cluster_m > 1 else None
      if grouped:
        # Entry m_tile of the grouped matmul's table: its weight, its
        # window of rows (on 8 rows, as tiled copies need) and the rows of it
        # that it owns. The window's other rows belong to other groups, or
        # lie past M where TMA reads zeros: they are computed, not stored.
        group, tile_rows = group_tiles.group[m_tile], group_tiles.rows[m_tile]
        row_start = group_tiles.row_start[m_tile]
        window = pl.multiple_of(row_start - row_start % ROW_ALIGNMENT, ROW_ALIGNMENT)
        cta_m_slice = pl.ds(window, cta_m)
        num_groups = rhs_gmem.shape[0]
        item_rhs_gmem = rhs_gmem.at[jnp.minimum(group, num_groups - 1)]
        first = row_start - window
        wg_first = 0 if config.wg_dimension == MatmulDimension.N else wg * tile_m
        wg_rows = tuple(jnp.clip(bound - wg_first, 0, tile_m)
                        for bound in (first, first + tile_rows))
      else:
        item_rhs_gmem, wg_rows = rhs_gmem, None
        out_tile = m_tile
        if ragged_k:
          # Group `group`'s rows [start, end), read from the 8-row-aligned
          # row at or below start.
          group, out_tile = m_tile // out_m_tiles, m_tile % out_m_tiles
          start, end = group_rows.start[group], group_rows.end[group]
          k_start = pl.multiple_of(start - start % ROW_ALIGNMENT, ROW_ALIGNMENT)
          item_k_steps = jnp.where(end > start,
                                   (end - k_start + config.tile_k - 1) // config.tile_k, 0)
        cta_m_slice = pl.ds(out_tile * cta_m, cta_m)
      cta_n_slice = pl.ds(n_tile * cta_n, cta_n)
      k_slice = pl.ds(split * split_k, k_steps * config.tile_k)
      if config.wg_dimension == MatmulDimension.M:
        wg_m_slice, wg_n_slice = pl.ds(wg * tile_m, tile_m), slice(None)
      else:
        wg_m_slice, wg_n_slice = slice(None), pl.ds(wg * tile_n, tile_n)
      if k_splits > 1:
        split_out = out_gmem.at[split]
      else:
        split_out = out_gmem.at[group] if ragged_k else out_gmem
      wg_out = split_out.at[cta_m_slice, cta_n_slice].at[wg_m_slice, wg_n_slice]
      wg_out_scales = None
      if quantized:
        # One row of scales per 128 of the warpgroup's columns (tile_n is
        # a multiple of them, and so is every CTA tile's first column).
        wg_first_column = n_tile * cta_n + (
            wg * tile_n if config.wg_dimension == MatmulDimension.N else 0)
        wg_out_scales = out_scales_gmem.at[
            pl.ds(wg_first_column // FP8_SCALE_BLOCK, tile_n // FP8_SCALE_BLOCK),
            cta_m_slice].at[:, wg_m_slice]
      wg_addend, wg_pre_activation, wg_up_product, wg_derivative = (
          None if gmem is None else gmem.at[cta_m_slice, cta_n_slice].at[wg_m_slice, wg_n_slice]
          for gmem in (addend_gmem, pre_activation_gmem, up_product_gmem, derivative_gmem))

      def mma_step(indices, lhs_smem, *rhs_smems_and_accs):
        *rhs_smems, acc_refs = rhs_smems_and_accs
        # A transposed operand's tile is read through a transposed view.
        if ragged_k:
          _zero_rows_of_other_groups(lhs_smem.at[:, wg_m_slice],
                                     k_start + indices[0] * config.tile_k, start, end)
        if layout.transpose_lhs:
          lhs_operand = lhs_smem.at[:, wg_m_slice].T
        else:
          lhs_operand = lhs_smem.at[wg_m_slice]
        rhs_operands = [rhs.T if layout.transpose_rhs else rhs for rhs in rhs_smems]
        per_wg = config.rhs_tiles_per_wg
        # Each RHS operand (the gate's and the up projection's, where gated)
        # has `config.rhs_tiles` tiles and `per_wg` accumulators per warpgroup.
        rhs_of = [rhs_operands[i * config.rhs_tiles:][:config.rhs_tiles] for i in range(num_rhs)]
        acc_of = [acc_refs[i * per_wg:][:per_wg] for i in range(num_rhs)]
        if config.rhs_tiles == per_wg:
          for accs, rhs_tiles in zip(acc_of, rhs_of, strict=True):
            for acc_ref, rhs_operand in zip(accs, rhs_tiles, strict=True):
              plgpu.wgmma(acc_ref, lhs_operand, rhs_operand)
        else:
          # Each warpgroup reads the RHS tiles of its own columns.
          for w in range(NUM_COMPUTE_WGS):
            @pl.when(wg == w)
            def _mma(w=w):
              for accs, rhs_tiles in zip(acc_of, rhs_of, strict=True):
                for acc_ref, rhs_operand in zip(accs, rhs_tiles[w * per_wg:][:per_wg],
                                                strict=True):
                  plgpu.wgmma(acc_ref, lhs_operand, rhs_operand)
        if pipeline_callback is not None:
          pipeline_callback(m_tile, n_tile, indices[0], lhs_smem)
        # The pipeline reuses a slot `delay_release` steps after this one, so
        # that many wgmmas may still be reading their slots.
        plgpu.wgmma_wait(delay_release)
        return acc_refs

      def compute_context(run_pipeline):
        if bias_gmem is not None:
          # Start the bias load now; it lands while the K loop runs.
          plgpu.copy_gmem_to_smem(bias_gmem.at[cta_n_slice].at[wg_n_slice],
                                  column_vector_row(bias_smem, wg, config), bias_loaded.at[wg])
        if column_scales_gmem is not None:
          plgpu.copy_gmem_to_smem(column_scales_gmem.at[cta_n_slice].at[wg_n_slice],
                                  column_vector_row(column_scales_smem, wg, config),
                                  column_scales_loaded.at[wg])

        # One accumulator per RHS tile of the warpgroup's columns, per RHS.
        @functools.partial(pl.run_scoped, acc_refs=[
            accumulator((tile_m, config.rhs_tile_width))] * (config.rhs_tiles_per_wg * num_rhs))
        def _acc_scope(acc_refs):
          with jax.named_scope("k_loop"):
            run_pipeline(tuple(acc_refs))
            # Waits for every wgmma of the tile.
            acc_blocks = [acc_ref[...] for acc_ref in acc_refs]
          acc_blocks, up_blocks = (acc_blocks[:config.rhs_tiles_per_wg],
                                   acc_blocks[config.rhs_tiles_per_wg:] or None)
          if tile_drained is not None:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # The callback's copies.
            plgpu.barrier_arrive(tile_drained)
          if bias_gmem is not None:
            plgpu.barrier_wait(bias_loaded.at[wg])
          if column_scales_gmem is not None:
            plgpu.barrier_wait(column_scales_loaded.at[wg])

          def run_epilogue():
            with jax.named_scope("epilogue"):
              store_epilogue(acc_blocks, wg, wg_out, out_smem, bias_smem, config, epilogue,
                             wg_addend, wg_pre_activation, up_blocks, wg_up_product,
                             wg_rows, rows_smem, wg_derivative, column_scales_smem,
                             wg_out_scales=wg_out_scales, out_scales_smem=out_scales_smem)
          if stores is None:
            run_epilogue()
          else:
            pl.when(stores)(run_epilogue)

      def store_zeros():
        # The rows past a grouped matmul's groups: zeros in the output,
        # without a K loop (a fresh accumulator holds zeros); a kept
        # derivative there is the identity's, which no cotangent reaches.
        @functools.partial(pl.run_scoped, acc_refs=[
            accumulator((tile_m, config.rhs_tile_width))] * config.rhs_tiles_per_wg)
        def _zeros_scope(acc_refs):
          store_epilogue([acc_ref[...] for acc_ref in acc_refs], wg, wg_out, out_smem, None,
                         config, Epilogue(), row_range=wg_rows, rows_smem=rows_smem,
                         wg_derivative=wg_derivative)

      if ragged_k:
        # The pipeline picks the group's rows (`_operand_pipeline`'s k_start).
        k_slice = slice(None)
      lhs_tiles = (lhs_gmem.at[k_slice, cta_m_slice] if layout.transpose_lhs
                   else lhs_gmem.at[cta_m_slice, k_slice])
      def rhs_tiles_of(gmem):
        return gmem.at[cta_n_slice, k_slice] if layout.transpose_rhs else gmem.at[k_slice,
                                                                                   cta_n_slice]

      rhs_tiles = [rhs_tiles_of(item_rhs_gmem)] * config.rhs_tiles
      if gated:
        rhs_tiles += [rhs_tiles_of(up_gmem)] * config.rhs_tiles

      def run_pipeline():
        # Each RHS spec picks its tiles of the CTA's columns.
        _operand_pipeline(config, dtype, item_k_steps if ragged_k else k_steps, delay_release,
                          layout, mma_step, compute_context, swizzle, num_rhs,
                          k_start=k_start if ragged_k else None, chained=chained)(
                              lhs_tiles, *rhs_tiles, allocations=pipeline_allocs)
      if ragged_k:
        # An empty group's gradient is zeros, with no K loop.
        pl.when(item_k_steps > 0)(run_pipeline)
        pl.when((item_k_steps == 0) & (wg < NUM_COMPUTE_WGS))(store_zeros)
      elif grouped:
        # Every warpgroup takes the same branch, so the pipeline's barriers
        # stay in step; entries past the table's last tile (no rows) do nothing.
        pl.when((group < num_groups) & (tile_rows > 0))(run_pipeline)
        pl.when((group == num_groups) & (tile_rows > 0) & (wg < NUM_COMPUTE_WGS))(store_zeros)
      else:
        run_pipeline()
      if tile_drained is not None:
        @pl.when(wg == NUM_COMPUTE_WGS)  # The memory warpgroup.
        def _wait_drained():
          plgpu.barrier_wait(tile_drained)

    for_each_work_item(config, m_tiles, pl.cdiv(n, cta_n), work_item)
    if chained:
      pl.when(wg == NUM_COMPUTE_WGS)(lambda: _await_last_releases(pipeline_allocs, config))

  # The last tile's stores must be done reading SMEM before the kernel
  # exits (their GMEM writes complete on their own).
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
