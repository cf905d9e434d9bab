"""The block-scaled FP8 matmul (sm_90): the kernel body.

Three bodies of one computation: (`Fp8Config.TILE_M`, `Fp8Config.TILE_N`)
output tiles per compute warpgroup, and a pipelined loop over K in steps of
one scale block (`Fp8Config.TILE_K` = 128). `emit_fp8_matmul` is a parallel
grid of one-warpgroup tiles (axes "m" and "n");
`emit_fp8_matmul_warp_specialized` the same grid of two-warpgroup tiles with
a memory warpgroup; `emit_fp8_matmul_persistent` (the default) the
two-warpgroup tiles walked by one block per SM.

Hopper's FP8 wgmma accumulates in the tensor cores with fewer bits than
float32, so a long K loses precision there. Each K step therefore runs its
wgmmas into a fresh accumulator, and the warpgroup adds that block's product,
times its scales (the LHS row's for the block, and the RHS block's), to a
float32 running sum in registers: the error of the tensor cores' sum spans
one block, whatever K is, and the scales never enter the 8-bit operands.

The RHS has one scale per (TILE_N, TILE_K) block, which each tile keeps in
SMEM for its whole K loop; or, with `rhs_row_scales`, one per row (an output
column) and K block, which the pipeline loads with each K step, as it loads
the LHS rows' scales: a weight gradient's RHS is a cotangent, whose columns
FP8 training recipes scale one by one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import accumulator, barrier, is_interpreting, smem, tile_transforms, tma_boxes
from pipelines.config import NUM_COMPUTE_WGS, Fp8Config
from pipelines.epilogue import Epilogue
from pipelines.fp8_quantize import block_scales
from pipelines.persistent_sm90 import MEMORY_WG_REGISTERS, WG_AXIS, for_each_work_item
from pipelines.pipelined_matmul_sm90 import M_AXIS, N_AXIS


def emit_fp8_matmul(lhs_gmem, rhs_gmem, lhs_scales_gmem, rhs_scales_gmem, *rest,
                    config: Fp8Config, epilogue: Epilogue, rhs_row_scales: bool = False) -> None:
  """Emits this block's tile of `out = epilogue(dequantized lhs @ dequantized rhs.T + bias)`.

  Must be called from a kernel with grid axes `M_AXIS` and `N_AXIS` over the
  output tiles and one warpgroup per block.

  Args:
    lhs_gmem: (M, K) float8_e4m3fn, K a multiple of `Fp8Config.TILE_K`.
    rhs_gmem: (N, K) float8_e4m3fn: the RHS stored transposed, since wgmma
      reads 8-bit operands K-major only.
    lhs_scales_gmem: (K // TILE_K, M) float32: the scale of each row's block
      of K, stored transposed, so that a step's scales for the tile's rows are
      one contiguous TMA copy.
    rhs_scales_gmem: (N // TILE_N, L) float32: each column block's scales per
      K step, padded to L = `Fp8Config.scale_row_length(K // TILE_K)`; with
      `rhs_row_scales`, (K // TILE_K, N) float32: each RHS row's scale per K
      step, stored transposed as the LHS's are.
    rest: the (N,) float32 bias GMEM ref if `epilogue.has_bias`, then the
      (M, N) output; M and N multiples of the tile. An e4m3 output is
      quantized in (1, TILE_N) blocks, and its scales follow it, stored
      transposed: (N // TILE_N, M) float32.
    config: the pipeline depth.
    epilogue: bias and activation, applied to the float32 sum.
    rhs_row_scales: which of the two forms `rhs_scales_gmem` has.
  """
  bias_gmem, out_gmem, out_scales_gmem = _outputs(rest, epilogue)
  block_scales_gmem = None if rhs_row_scales else rhs_scales_gmem
  tile_m, tile_n, tile_k = config.TILE_M, config.TILE_N, config.TILE_K
  k_steps = lhs_gmem.shape[1] // tile_k
  m_index, n_index = lax.axis_index(M_AXIS), lax.axis_index(N_AXIS)
  m_slice = pl.ds(m_index * tile_m, tile_m)
  n_slice = pl.ds(n_index * tile_n, tile_n)

  def with_tile_constants(rhs_scales_smem=None, constants_loaded=None, bias_smem=None):
    if constants_loaded is not None:
      _load_tile_constants(block_scales_gmem, bias_gmem, n_index, rhs_scales_smem, bias_smem,
                           constants_loaded)
      plgpu.barrier_wait(constants_loaded)

    def step(indices, lhs_smem, rhs_smem, lhs_scales_smem, *rest):
      *column_scales_smem, running_sum = rest
      return _add_scaled_block_product(running_sum, lhs_smem, rhs_smem, lhs_scales_smem.at[0],
                                       released_by_arrive=False,
                                       **_rhs_scales_of_step(indices, rhs_scales_smem,
                                                             column_scales_smem))

    total = plgpu.emit_pipeline(
        step,
        grid=(k_steps,),
        in_specs=_operand_specs(tile_m, config, lhs_gmem.dtype, rhs_row_scales),
        max_concurrent_steps=config.pipeline.steps_for(k_steps),
        init_carry=_zeros((tile_m, tile_n)),
    )(*_operand_tiles(lhs_gmem, rhs_gmem, lhs_scales_gmem, rhs_scales_gmem, m_slice, n_slice,
                      rhs_row_scales))
    out = _finish(total, bias_smem, epilogue)

    def store(out_smem, out_scales_smem=None):
      _store_output(out, out_smem, out_gmem.at[m_slice, n_slice], out_scales_smem,
                    _scales_row(out_scales_gmem, n_index, m_slice))

    pl.run_scoped(store, smem((tile_m, tile_n), out_gmem.dtype, swizzled=True),
                  **_scales_scratch(out_scales_gmem, (1, tile_m)))

  pl.run_scoped(with_tile_constants, **_tile_constants_scratch(block_scales_gmem, epilogue))


def emit_fp8_matmul_warp_specialized(lhs_gmem, rhs_gmem, lhs_scales_gmem, rhs_scales_gmem,
                                     *rest, config: Fp8Config, epilogue: Epilogue,
                                     rhs_row_scales: bool = False) -> None:
  """`emit_fp8_matmul` on (128, TILE_N) tiles: two compute warpgroups, one per
  64 rows, and a memory warpgroup that loads each step's operands once for
  both (twice the multiply-adds per byte read of one warpgroup's tile).

  While one compute warpgroup scales its step's product, the other's wgmmas
  can run. Must be called from a kernel with grid axes `M_AXIS` and `N_AXIS`
  and `NUM_COMPUTE_WGS` + 1 warpgroups on `WG_AXIS`; the arguments are
  `emit_fp8_matmul`'s, with M a multiple of 128.
  """
  bias_gmem, out_gmem, out_scales_gmem = _outputs(rest, epilogue)
  block_scales_gmem = None if rhs_row_scales else rhs_scales_gmem
  wg_m, tile_n, tile_k = config.TILE_M, config.TILE_N, config.TILE_K
  cta_m = NUM_COMPUTE_WGS * wg_m
  k_steps = lhs_gmem.shape[1] // tile_k
  m_index, n_index = lax.axis_index(M_AXIS), lax.axis_index(N_AXIS)
  wg = lax.axis_index(WG_AXIS)
  m_slice = pl.ds(m_index * cta_m, cta_m)
  n_slice = pl.ds(n_index * tile_n, tile_n)
  wg_rows = pl.ds(wg * wg_m, wg_m)

  def scoped(out_smem, rhs_scales_smem=None, constants_loaded=None, bias_smem=None,
             out_scales_smem=None):
    def step(indices, lhs_smem, rhs_smem, lhs_scales_smem, *rest):
      # The memory warpgroup refills the step's slots once both compute
      # warpgroups have released them, after this returns.
      *column_scales_smem, running_sum = rest
      return _add_scaled_block_product(running_sum, lhs_smem.at[wg_rows], rhs_smem,
                                       lhs_scales_smem.at[0, wg_rows], released_by_arrive=True,
                                       **_rhs_scales_of_step(indices, rhs_scales_smem,
                                                             column_scales_smem))

    def compute_context(run_pipeline):
      if constants_loaded is not None:
        # The tile's constants, loaded once by the first compute warpgroup;
        # both wait for them.
        @pl.when(wg == 0)
        def _load_constants():
          _load_tile_constants(block_scales_gmem, bias_gmem, n_index, rhs_scales_smem,
                               bias_smem, constants_loaded)

        plgpu.barrier_wait(constants_loaded)
      total = run_pipeline(_zeros((wg_m, tile_n)))
      _store_warpgroup_rows(_finish(total, bias_smem, epilogue), wg, out_smem, out_gmem,
                            out_scales_smem, out_scales_gmem, n_index, m_slice, n_slice)

    _warp_specialized_pipeline(step, compute_context, rows=cta_m, k_steps=k_steps,
                               config=config, dtype=lhs_gmem.dtype,
                               rhs_row_scales=rhs_row_scales)(
        *_operand_tiles(lhs_gmem, rhs_gmem, lhs_scales_gmem, rhs_scales_gmem, m_slice, n_slice,
                        rhs_row_scales))

  # Allocated once for all warpgroups of the block.
  pl.run_scoped(scoped, smem((NUM_COMPUTE_WGS, wg_m, tile_n), out_gmem.dtype, swizzled=True),
                **_tile_constants_scratch(block_scales_gmem, epilogue),
                **_scales_scratch(out_scales_gmem, (NUM_COMPUTE_WGS, 1, wg_m)),
                collective_axes=WG_AXIS)


def emit_fp8_matmul_persistent(lhs_gmem, rhs_gmem, lhs_scales_gmem, rhs_scales_gmem, *rest,
                               config: Fp8Config, epilogue: Epilogue,
                               rhs_row_scales: bool = False) -> None:
  """`emit_fp8_matmul_warp_specialized`'s tiles, of `config.compute_wgs`
  warpgroups' rows (`config.cta_tile_m`), walked by one persistent block per
  SM (`persistent_sm90.for_each_work_item`, in `config.tile_order`).

  The memory warpgroup runs ahead into the block's next tile, so its loads
  overlap the compute warpgroups' epilogue. Each compute warpgroup loads its
  own copy of a tile's constants (RHS scales, bias) after its epilogue of the
  last tile: one warpgroup starting a tile never overwrites what the other
  still reads. Must be called from a kernel with grid axis `SM_AXIS` and
  `config.compute_wgs` + 1 warpgroups on `WG_AXIS`; the arguments are
  `emit_fp8_matmul`'s, with M a multiple of 8 and at least
  `config.cta_tile_m` (not necessarily a multiple of it).
  """
  bias_gmem, out_gmem, out_scales_gmem = _outputs(rest, epilogue)
  block_scales_gmem = None if rhs_row_scales else rhs_scales_gmem
  wg_m, tile_n, tile_k = config.TILE_M, config.TILE_N, config.TILE_K
  compute_wgs = config.compute_wgs
  cta_m = config.cta_tile_m
  m, k = lhs_gmem.shape
  k_blocks = k // tile_k
  blocks = config.blocks_per_step(k_blocks)
  k_steps = k_blocks // blocks
  n_tiles = rhs_gmem.shape[0] // tile_n
  wg = lax.axis_index(WG_AXIS)
  wg_rows = pl.ds(wg * wg_m, wg_m)

  def pipeline(step, compute_context):
    return _warp_specialized_pipeline(step, compute_context, rows=cta_m, k_steps=k_steps,
                                      config=config, dtype=lhs_gmem.dtype,
                                      rhs_row_scales=rhs_row_scales, blocks=blocks)

  def ignore(*_, **__):
    return None

  column_scales = ((jax.ShapeDtypeStruct((k_blocks, tile_n), jnp.float32),) if rhs_row_scales
                   else ())
  pipeline_allocs = pipeline(ignore, ignore).get_allocations(
      jax.ShapeDtypeStruct((cta_m, k), lhs_gmem.dtype),
      jax.ShapeDtypeStruct((tile_n, k), rhs_gmem.dtype),
      jax.ShapeDtypeStruct((k_blocks, cta_m), jnp.float32), *column_scales)

  def scoped(pipeline_allocs, out_smem, rhs_scales_smem=None, constants_loaded=None,
             bias_smem=None, out_scales_smem=None):
    def work_item(_, m_tile, n_tile, __):
      m_slice = pl.ds(m_tile * cta_m, cta_m)
      n_slice = pl.ds(n_tile * tile_n, tile_n)

      def step(indices, lhs_smem, rhs_smem, lhs_scales_smem, *rest):
        *column_scales_smem, running_sum = rest
        block_scales = None if rhs_scales_smem is None else rhs_scales_smem.at[wg]
        if blocks == 1:
          return _add_scaled_block_product(
              running_sum, lhs_smem.at[wg_rows], rhs_smem, lhs_scales_smem.at[0, wg_rows],
              released_by_arrive=True,
              **_rhs_scales_of_step(indices, block_scales, column_scales_smem))
        return _add_two_scaled_block_products(
            running_sum, indices, lhs_smem.at[wg_rows], rhs_smem, lhs_scales_smem.at[:, wg_rows],
            block_scales, column_scales_smem)

      def compute_context(run_pipeline):
        if constants_loaded is not None:
          # The last tile's reads of these constants (register loads) come
          # before the copies that overwrite them.
          plgpu.commit_smem()
          _load_tile_constants(block_scales_gmem, bias_gmem, n_tile,
                               None if rhs_scales_smem is None else rhs_scales_smem.at[wg],
                               None if bias_smem is None else bias_smem.at[wg],
                               constants_loaded.at[wg])
          plgpu.barrier_wait(constants_loaded.at[wg])
        total = run_pipeline(_zeros((wg_m, tile_n)))
        _store_warpgroup_rows(
            _finish(total, None if bias_smem is None else bias_smem.at[wg], epilogue), wg,
            out_smem, out_gmem, out_scales_smem, out_scales_gmem, n_tile, m_slice, n_slice)

      pipeline(step, compute_context)(
          *_operand_tiles(lhs_gmem, rhs_gmem, lhs_scales_gmem, rhs_scales_gmem, m_slice,
                          n_slice, rhs_row_scales),
          allocations=pipeline_allocs)

    # The last row tile may reach past M: TMA fills its loads there with
    # zeros and drops its stores.
    for_each_work_item(config.tile_order, pl.cdiv(m, cta_m), n_tiles, work_item)

  # Allocated once for all warpgroups of the block, and for all its tiles.
  pl.run_scoped(scoped, pipeline_allocs=pipeline_allocs,
                out_smem=smem((compute_wgs, wg_m, tile_n), out_gmem.dtype, swizzled=True),
                **_tile_constants_scratch(block_scales_gmem, epilogue, copies=compute_wgs),
                **_scales_scratch(out_scales_gmem, (compute_wgs, 1, wg_m)),
                collective_axes=WG_AXIS)


def _warp_specialized_pipeline(step, compute_context, *, rows: int, k_steps: int,
                               config: Fp8Config, dtype, rhs_row_scales: bool, blocks: int = 1):
  """The memory warpgroup's pipeline of a (rows, TILE_N) tile's K steps of
  `blocks` scale blocks each (`_operand_specs`), feeding `step` in
  `config.compute_wgs` compute warpgroups."""
  return plgpu.emit_pipeline_warp_specialized(
      step,
      grid=(k_steps,),
      memory_registers=memory_registers(config.compute_wgs),
      in_specs=_operand_specs(rows, config, dtype, rhs_row_scales, blocks),
      wg_axis=WG_AXIS,
      num_compute_wgs=config.compute_wgs,
      max_concurrent_steps=config.pipeline.steps_for(k_steps),
      compute_context=compute_context,
  )


def memory_registers(compute_wgs: int) -> int:
  """Registers per thread the memory warpgroup keeps beside `compute_wgs`
  compute warpgroups. Beside three, it keeps setmaxnreg's least (24), so
  that each compute warpgroup gets 160: its accumulator and running sum
  take 128."""
  return MEMORY_WG_REGISTERS if compute_wgs <= NUM_COMPUTE_WGS else 24


def _zeros(shape: tuple[int, int]) -> jax.Array:
  """A float32 running sum of zeros in the accumulator's register layout."""
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _rhs_scales_of_step(indices, block_scales_smem, column_scales_smem, *, block: int = 0,
                        blocks: int = 1) -> dict:
  """The RHS scales of block `block` of a step of `blocks` scale blocks, as
  `_add_scaled_block_product`'s keywords: its block's scale (a scalar from
  the tile's `block_scales_smem` row), or the (TILE_N,) SMEM row of its
  columns' scales (in the pipeline's (blocks, TILE_N) slot,
  `column_scales_smem` = [it], empty without `rhs_row_scales`)."""
  if column_scales_smem:
    (column_scales,) = column_scales_smem
    return dict(column_scales_smem=column_scales.at[block])
  (k,) = indices
  return dict(rhs_scale=block_scales_smem[blocks * k + block])


def _add_scaled_block_product(running_sum, lhs_operand, rhs_smem, row_scales_smem, *,
                              rhs_scale=None, column_scales_smem=None,
                              released_by_arrive: bool) -> jax.Array:
  """`running_sum` + (lhs_operand @ rhs_smem.T) * row_scales * rhs_scales: one
  K step's product, on the tensor cores into a fresh accumulator, scaled and
  added in float32 registers.

  Args:
    running_sum: (rows, TILE_N) float32, WGMMA layout.
    lhs_operand: (rows, TILE_K) e4m3 SMEM tile of the step.
    rhs_smem: (TILE_N, TILE_K) e4m3 SMEM tile of the step (K-major).
    row_scales_smem: (rows,) float32 SMEM, the LHS rows' scales of the step.
    rhs_scale: the RHS block's scale of the step (a float32 scalar); or
    column_scales_smem: (TILE_N,) float32 SMEM, the RHS rows' (the output
      columns') scales of the step.
    released_by_arrive: whether the step's slots are refilled only after an
      mbarrier arrive of this warpgroup (the warp-specialized pipelines), or
      by this warpgroup itself (`emit_pipeline`): see
      `_order_scale_loads_before_refill`.
  """
  def block_product(acc_ref):
    plgpu.wgmma(acc_ref, lhs_operand, rhs_smem.T)
    scales = None
    if column_scales_smem is None:
      # A block scale makes one factor a row, a register or two a thread:
      # load them while the wgmmas run, not after them while the tensor
      # cores idle (4-7% faster on an H100; docs/performance-log.md,
      # "FP8's scales loaded while the wgmmas run"). Per-column scales
      # are 64 registers a thread more, so they wait for the product.
      scales = _ordered_scale_factors(row_scales_smem, running_sum.shape,
                                      released_by_arrive=released_by_arrive, rhs_scale=rhs_scale)
    # Reading the accumulator waits for the wgmmas, so none still reads the
    # step's slots when the pipeline refills them after the step.
    return acc_ref[...], scales

  product, scales = pl.run_scoped(block_product, accumulator(running_sum.shape))
  if scales is None:
    scales = _ordered_scale_factors(row_scales_smem, product.shape,
                                    released_by_arrive=released_by_arrive,
                                    column_scales_smem=column_scales_smem)
  return running_sum + product * scales


def _ordered_scale_factors(row_scales_smem, shape, *, released_by_arrive: bool,
                           **rhs_scales) -> jax.Array:
  """`_block_scale_factors`, its SMEM loads ordered before the TMA copies
  that refill the step's slots after the step (`_order_scale_loads_before_refill`)."""
  scales = _block_scale_factors(row_scales_smem, shape, **rhs_scales)
  _order_scale_loads_before_refill(released_by_arrive=released_by_arrive)
  return scales


def _order_scale_loads_before_refill(*, released_by_arrive: bool) -> None:
  """Orders a step's SMEM loads of scales before the TMA copies that refill
  the step's slots.

  Where the slots are refilled only after this warpgroup's mbarrier arrive
  (`released_by_arrive`: a memory warpgroup refills them), the GPU needs no
  instruction for it: the arrive's release semantics order the earlier
  loads before it, and the memory warpgroup starts the refill only after it
  observes the arrive. (Block-scaled GEMMs in CUTLASS and DeepGEMM read
  their scales from SMEM the same way.) The interpreter's race detector,
  though, orders a thread's SMEM reads before a TMA write only through a
  proxy fence (`commit_smem`), so in interpret mode they get one. Where this
  warpgroup issues the refill itself (`emit_pipeline`), nothing but program
  order stands between the loads and the copy, so the fence stays. On the
  GPU it is a memory barrier, the async-proxy fence and a barrier of the
  warpgroup every K step, whose removal made the forward 1.02-1.04x faster on
  an H100 (docs/performance-log.md, "The fence after the scale loads").
  """
  if is_interpreting() or not released_by_arrive:
    plgpu.commit_smem()


def _add_two_scaled_block_products(running_sum, indices, lhs_operand, rhs_smem,
                                   row_scales_smem, block_scales_smem,
                                   column_scales_smem) -> jax.Array:
  """`_add_scaled_block_product` of a K step of two scale blocks: both
  blocks' wgmmas go out at once, each into its own accumulator, and the
  first block's product is scaled and added while the second's runs, so the
  tensor cores idle only while the second is added.

  Args:
    running_sum: (rows, TILE_N) float32, WGMMA layout.
    indices: the pipeline step's (k,): blocks 2k and 2k + 1.
    lhs_operand: (rows, 2 TILE_K) e4m3 SMEM tile of the step.
    rhs_smem: (TILE_N, 2 TILE_K) e4m3 SMEM tile of the step (K-major).
    row_scales_smem: (2, rows) float32 SMEM, the LHS rows' scales of each block.
    block_scales_smem: the tile's row of RHS block scales, or None with
    column_scales_smem: [(2, TILE_N) float32 SMEM], the RHS rows' scales of
      each block (empty without RHS row scales).
  """
  tile_k = Fp8Config.TILE_K

  def factors(block):
    return _block_scale_factors(
        row_scales_smem.at[block], running_sum.shape,
        **_rhs_scales_of_step(indices, block_scales_smem, column_scales_smem, block=block,
                              blocks=2))

  def products(acc_first, acc_second):
    for block, acc in enumerate((acc_first, acc_second)):
      k_slice = pl.ds(block * tile_k, tile_k)
      plgpu.wgmma(acc, lhs_operand.at[:, k_slice], rhs_smem.at[:, k_slice].T)
    # The scales are read while the wgmmas run. A block scale makes one
    # factor a row, but per-column scales make 64 registers a thread, which
    # beside the running sum and two accumulators spill: those of the second
    # block are read once the first block's are used.
    first_factors = factors(0)
    second_factors = None if column_scales_smem else factors(1)
    # The pipeline refills the step's slots by TMA after the step: order the
    # register loads of the scales before that write to them. Only the
    # warp-specialized kernels take two blocks a step, so a memory warpgroup
    # refills the slots, after this warpgroup's arrive.
    if second_factors is not None:
      _order_scale_loads_before_refill(released_by_arrive=True)
    # The first block's wgmmas are done, the second's may run on.
    partial = running_sum + plgpu.wgmma_accumulator_load(acc_first, wait_n=1) * first_factors
    if second_factors is None:
      second_factors = factors(1)
      _order_scale_loads_before_refill(released_by_arrive=True)
    return partial + plgpu.wgmma_accumulator_load(acc_second, wait_n=0) * second_factors

  return pl.run_scoped(products, accumulator(running_sum.shape),
                       accumulator(running_sum.shape))


def _block_scale_factors(row_scales_smem, shape, *, rhs_scale=None,
                         column_scales_smem=None) -> jax.Array:
  """A scale block's (rows, TILE_N) float32 factors, in the WGMMA layout: its
  LHS rows' scales (`row_scales_smem`, (rows,) SMEM) times the RHS block's
  `rhs_scale`, or times its RHS rows' (the output columns') scales
  (`column_scales_smem`, (TILE_N,) SMEM)."""
  # One value per accumulator row: a plain load does (the optimized vector
  # loads are for the layouts of whole tiles).
  row_scales = plgpu.load(row_scales_smem, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
  if column_scales_smem is None:
    return lax.broadcast_in_dim(row_scales * rhs_scale, shape, (0,))
  # Per column as well: one more multiply an element.
  column_scales = plgpu.load(column_scales_smem, layout=plgpu.Layout.WGMMA.reduce(0))
  return (lax.broadcast_in_dim(row_scales, shape, (0,))
          * lax.broadcast_in_dim(column_scales, shape, (1,)))


def _finish(total, bias_smem, epilogue: Epilogue) -> jax.Array:
  """The float32 sum with the tile's bias (if any) and the activation applied."""
  if bias_smem is not None:
    bias = plgpu.load(bias_smem, layout=plgpu.Layout.WGMMA.reduce(0))
    total = total + lax.broadcast_in_dim(bias, total.shape, (1,))
  return epilogue.apply(total)


def _outputs(rest, epilogue: Epilogue):
  """(bias GMEM ref or None, output, output scales or None) from the refs after
  the four operands: the bias if `epilogue.has_bias`, the output, and the
  output's scales where the output is e4m3."""
  bias_gmem, rest = (rest[0], rest[1:]) if epilogue.has_bias else (None, rest)
  out_gmem, *out_scales = rest
  return bias_gmem, out_gmem, (out_scales[0] if out_scales else None)


def _operand_specs(rows: int, config: Fp8Config, dtype, rhs_row_scales: bool,
                   blocks: int = 1) -> list:
  """The pipeline's inputs per K step of `blocks` scale blocks: `rows` of
  the LHS and the tile's columns of the RHS, K-major and swizzled for wgmma,
  the LHS rows' scales of the step's blocks and, with `rhs_row_scales`, the
  RHS rows' (`_operand_tiles`)."""
  transforms = tile_transforms(config.TILE_K, dtype)
  width = blocks * config.TILE_K
  specs = [plgpu.BlockSpec((rows, width), lambda k: (0, k), transforms=transforms),
           plgpu.BlockSpec((config.TILE_N, width), lambda k: (0, k), transforms=transforms),
           plgpu.BlockSpec((blocks, rows), lambda k: (k, 0))]
  if rhs_row_scales:
    specs.append(plgpu.BlockSpec((blocks, config.TILE_N), lambda k: (k, 0)))
  return specs


def _operand_tiles(lhs_gmem, rhs_gmem, lhs_scales_gmem, rhs_scales_gmem, m_slice, n_slice,
                   rhs_row_scales: bool) -> tuple:
  """The GMEM refs of a tile's pipeline inputs (`_operand_specs`): its rows of
  the LHS and their scales, its columns of the RHS and, with
  `rhs_row_scales`, their scales (the block scales are the tile's constants)."""
  tiles = (lhs_gmem.at[m_slice], rhs_gmem.at[n_slice], lhs_scales_gmem.at[:, m_slice])
  return (*tiles, rhs_scales_gmem.at[:, n_slice]) if rhs_row_scales else tiles


def _tile_constants_scratch(block_scales_gmem, epilogue: Epilogue, copies: int | None = None
                            ) -> dict:
  """The SMEM of a tile's constants, read by every K step and the epilogue:
  its column block's RHS scales (`rhs_scales_smem`, unless
  `block_scales_gmem` is None: the RHS is scaled per row), its bias
  (`bias_smem`, if any), and the barrier their copies arrive on, once each;
  none of these where there is neither. With `copies`, that many of each
  (the persistent kernel's one per compute warpgroup), each row padded to
  `Fp8Config.constants_row_length`, and a barrier per copy."""
  scale_copies = 0 if block_scales_gmem is None else len(tma_boxes(block_scales_gmem.shape[1]))
  arrivals = scale_copies + epilogue.has_bias
  if not arrivals:
    return {}

  def row(length):
    return (length,) if copies is None else (copies, Fp8Config.constants_row_length(length))
  scratch = dict(constants_loaded=barrier(num_arrivals=arrivals, num_barriers=copies or 1))
  if block_scales_gmem is not None:
    scratch["rhs_scales_smem"] = plgpu.SMEM(row(block_scales_gmem.shape[1]), jnp.float32)
  if epilogue.has_bias:
    scratch["bias_smem"] = plgpu.SMEM(row(Fp8Config.TILE_N), jnp.float32)
  return scratch


def _load_tile_constants(block_scales_gmem, bias_gmem, n_index, rhs_scales_smem, bias_smem,
                         constants_loaded) -> None:
  """Starts the copies of column block `n_index`'s RHS scales (unless
  `block_scales_gmem` is None) and bias (if any) into
  `_tile_constants_scratch`'s SMEM. A row of more than `TMA_MAX_BOX` scales
  (K over 32768) takes several copies."""
  if block_scales_gmem is not None:
    for box in tma_boxes(block_scales_gmem.shape[1]):
      plgpu.copy_gmem_to_smem(block_scales_gmem.at[n_index, box], rhs_scales_smem.at[box],
                              constants_loaded)
  if bias_smem is not None:
    n_slice = pl.ds(n_index * Fp8Config.TILE_N, Fp8Config.TILE_N)
    plgpu.copy_gmem_to_smem(bias_gmem.at[n_slice], bias_smem, constants_loaded)


def _scales_scratch(out_scales_gmem, shape: tuple[int, ...]) -> dict:
  """The SMEM of a quantized output's scales (`out_scales_smem`; none for a
  plain output)."""
  if out_scales_gmem is None:
    return {}
  return dict(out_scales_smem=plgpu.SMEM(shape, jnp.float32))


def _scales_row(out_scales_gmem, n_index, m_slice):
  """The (1, rows) GMEM ref of the tile's output scales, or None for a plain
  output."""
  if out_scales_gmem is None:
    return None
  return out_scales_gmem.at[pl.ds(n_index, 1), m_slice]


def _store_warpgroup_rows(value, wg, out_smem, out_gmem, out_scales_smem, out_scales_gmem,
                          n_index, m_slice, n_slice) -> None:
  """`_store_output` of compute warpgroup `wg`'s (TILE_M, TILE_N) `value`: its
  rows of the (m_slice, n_slice) tile, through its own SMEM staging tile (and
  scales row, for an e4m3 output) of the block's `NUM_COMPUTE_WGS`."""
  wg_rows = pl.ds(wg * Fp8Config.TILE_M, Fp8Config.TILE_M)
  scales_row = _scales_row(out_scales_gmem, n_index, m_slice)
  _store_output(value, out_smem.at[wg], out_gmem.at[m_slice, n_slice].at[wg_rows],
                None if out_scales_smem is None else out_scales_smem.at[wg],
                None if scales_row is None else scales_row.at[:, wg_rows])


def _store_output(value, out_smem, out_gmem, scales_smem=None, scales_gmem=None) -> None:
  """Stores a warpgroup's (rows, TILE_N) float32 result through `out_smem`
  with TMA: cast to the output's dtype or, given `scales_smem`, quantized to
  e4m3 with one scale per row (its largest magnitude over e4m3's largest
  value, as `quantize_fp8` has it), the scales stored to `scales_gmem` (1,
  rows). Waits until the copies have read SMEM."""
  if scales_smem is not None:
    scales = block_scales(jnp.max(jnp.abs(value), axis=1))
    value = value / lax.broadcast_in_dim(scales, value.shape, (0,))
    scales_smem[0, :] = scales
  out_smem[...] = value.astype(out_smem.dtype)
  plgpu.commit_smem()  # Register stores must be visible to the TMA engine.
  plgpu.copy_smem_to_gmem(out_smem, out_gmem)
  if scales_smem is not None:
    plgpu.copy_smem_to_gmem(scales_smem, scales_gmem)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
