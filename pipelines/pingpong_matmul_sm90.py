"""The ping-pong schedule of the warp-specialized persistent matmul (sm_90): the kernel body.

Same grid, tile order and warpgroups (`persistent_sm90`) and epilogue as the
cooperative schedule (`cooperative_matmul_sm90`), but the
two compute warpgroups do not split a CTA tile: each block's tiles go to them
alternately (its local tile j to warpgroup j % 2), and each warpgroup
accumulates a whole (tile_m, tile_n) tile. The memory warpgroup fills one
ring of `max_concurrent_steps` SMEM slots with the K steps of the block's
tiles in order, so the ring runs across tile boundaries: while one
warpgroup finishes its K loop the loads for the other's next tile already
fill the slots it frees. Nothing else orders the warpgroups; the loads pace
them, so a warpgroup's epilogue (conversion, bias, activation, TMA stores)
runs under the other's wgmmas instead of leaving the tensor cores idle, as
the cooperative schedule does.

A slot is used by both warpgroups in turn, but its barriers are not shared:
each slot has a "loaded" and a "consumed" barrier per warpgroup, and a
load arrives on those of the warpgroup whose tile it belongs to. Mosaic GPU
tracks the phase of a barrier per waiting thread, so a warpgroup that waited
on only its own uses of a shared barrier would lose track of its phase.
"""

from __future__ import annotations

import functools

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import accumulator, barrier, smem
from pipelines.config import NUM_COMPUTE_WGS, TuningConfig, operand_swizzle
from pipelines.epilogue import (
  Epilogue,
  column_vector_row,
  epilogue_scratch,
  output_swizzle,
  store_epilogue,
)
from pipelines.operands import NN, OperandLayout
from pipelines.persistent_sm90 import (
    MEMORY_WG_REGISTERS,
    SM_AXIS,
    WG_AXIS,
    compute_registers,
    for_each_work_item,
)

# The copies that arrive on a slot's "loaded" barrier: the LHS and RHS tiles.
_COPIES_PER_SLOT = 2


def pingpong_scratch(config: TuningConfig, dtype, out_dtype, *, k: int, has_bias: bool,
                     layout: OperandLayout = NN, swizzle: int | None = None,
                     out_swizzle: int | None = None) -> dict:
  """The SMEM `emit_pingpong_matmul` allocates for K = `k`, by name.

  The kernel allocates exactly this, and `kernel_call.ws_smem_budget` sums
  it. One ring of `max_concurrent_steps` slots per operand, not clamped to
  a tile's K steps: the ring runs across tiles. `swizzle` and `out_swizzle`
  as for `cooperative_matmul_sm90.cooperative_scratch`.
  """
  del k  # The ring does not depend on K.
  slots = config.max_concurrent_steps
  return dict(
      # Tiles as the operands are stored (`OperandLayout`).
      lhs_smem=smem((slots, *layout.lhs_shape(config.tile_m, config.tile_k)), dtype,
                    swizzled=True, swizzle=swizzle),
      rhs_smem=smem((slots, *layout.rhs_shape(config.tile_k, config.tile_n)), dtype,
                    swizzled=True, swizzle=swizzle),
      # Warpgroup w's barriers for slot s are number w * slots + s.
      loaded=barrier(num_barriers=config.slot_barrier_sets * slots,
                     num_arrivals=_COPIES_PER_SLOT),
      consumed=barrier(num_barriers=config.slot_barrier_sets * slots),
      **epilogue_scratch(config, out_dtype, has_bias=has_bias, swizzle=out_swizzle),
  )


def emit_pingpong_matmul(lhs_gmem, rhs_gmem, out_gmem, bias_gmem=None, *, config: TuningConfig,
                         epilogue: Epilogue = Epilogue(), layout: OperandLayout = NN,
                         derivative_gmem=None) -> None:
  """Emits `out_gmem = epilogue(lhs_gmem @ rhs_gmem + bias_gmem)` inside a kernel.

  Must be called from a kernel built by `kernel_call.persistent_kernel`
  (grid axis `SM_AXIS`, at most one block per output tile, three threads on
  `WG_AXIS`). Shapes as for `cooperative_matmul_sm90.emit_cooperative_matmul`
  (without a split of K): static, and M, N and K may be ragged.

  Args:
    lhs_gmem: (M, K) ref, or (K, M) with `layout.transpose_lhs`.
    rhs_gmem: (K, N) ref, or (N, K) with `layout.transpose_rhs`.
    out_gmem: (M, N) ref.
    bias_gmem: (N,) float32 ref, or None.
    config: a `TuningConfig` with `schedule=Schedule.PINGPONG`.
    layout: how lhs_gmem and rhs_gmem are stored; transposed operands are
      loaded as stored and handed to wgmma as transposed SMEM views.
    derivative_gmem: (M, N) ref of `out_gmem`'s dtype, or None: also
      receives the activation's derivative at the sum (for a backward pass:
      `Epilogue.keeps_derivative`).
  """
  k, m = lhs_gmem.shape if layout.transpose_lhs else lhs_gmem.shape[::-1]
  n = rhs_gmem.shape[0] if layout.transpose_rhs else rhs_gmem.shape[1]
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  # A last partial K step reads past the arrays' end: TMA fills it with zeros.
  m_tiles, n_tiles, k_steps = pl.cdiv(m, tile_m), pl.cdiv(n, tile_n), pl.cdiv(k, tile_k)
  slots = config.max_concurrent_steps
  # A step's slot goes back to the memory warpgroup once the wgmma reading it
  # is done. Leaving one wgmma in flight releases the previous step's slot,
  # which the next load may need only if the ring has two slots or more.
  in_flight = 1 if slots > 1 else 0
  scratch = pingpong_scratch(
      config, lhs_gmem.dtype, out_gmem.dtype, k=k, has_bias=bias_gmem is not None,
      layout=layout, out_swizzle=output_swizzle(config, out_gmem),
      swizzle=operand_swizzle(config, lhs_gmem, rhs_gmem, transpose_lhs=layout.transpose_lhs,
                              transpose_rhs=layout.transpose_rhs))

  def tile_loop(body):
    """Runs `body(owner, first_position, m_tile, n_tile)` for each of this block's tiles.

    `owner` is the compute warpgroup the tile belongs to. A position counts
    the K steps of the block's tiles in order; `first_position` is that of
    the tile's first step.
    """
    def work_item(_, m_tile, n_tile, local):
      body(local % NUM_COMPUTE_WGS, local * k_steps, m_tile, n_tile)
    for_each_work_item(config, m_tiles, n_tiles, work_item)

  def slot_of(position):
    return lax.rem(position, slots)

  def barrier_of(position, owner=None):
    """The index of `position`'s barriers (owner: its tile's warpgroup, if known)."""
    if owner is None:
      owner = lax.rem(lax.div(position, k_steps), NUM_COMPUTE_WGS)
    return owner * slots + slot_of(position)

  @functools.partial(pl.run_scoped, **scratch, collective_axes=WG_AXIS)
  def _scope(lhs_smem, rhs_smem, out_smem, loaded, consumed, bias_smem=None, bias_loaded=None):
    wg = lax.axis_index(WG_AXIS)

    @pl.when(wg == NUM_COMPUTE_WGS)
    def _memory_warpgroup():
      plgpu.set_max_registers(MEMORY_WG_REGISTERS, action="decrease")

      def load_tile(owner, first_position, m_tile, n_tile):
        @pl.loop(0, k_steps)
        def _load_step(kk):
          position = first_position + kk
          slot = slot_of(position)

          @pl.when(position >= slots)
          def _wait_for_release():  # Of the slot's previous position, by its owner.
            plgpu.barrier_wait(consumed.at[barrier_of(position - slots)])

          k_slice = pl.ds(kk * tile_k, tile_k)
          bar = loaded.at[barrier_of(position, owner)]
          m_slice, n_slice = pl.ds(m_tile * tile_m, tile_m), pl.ds(n_tile * tile_n, tile_n)
          lhs_tile = (lhs_gmem.at[k_slice, m_slice] if layout.transpose_lhs
                      else lhs_gmem.at[m_slice, k_slice])
          rhs_tile = (rhs_gmem.at[n_slice, k_slice] if layout.transpose_rhs
                      else rhs_gmem.at[k_slice, n_slice])
          plgpu.copy_gmem_to_smem(lhs_tile, lhs_smem.at[slot], bar)
          plgpu.copy_gmem_to_smem(rhs_tile, rhs_smem.at[slot], bar)

      tile_loop(load_tile)
      # Wait for the releases of the last positions too, so that no barrier
      # is left mid-phase when the kernel ends.
      num_local_tiles = pl.cdiv(m_tiles * n_tiles - lax.axis_index(SM_AXIS),
                                lax.axis_size(SM_AXIS))
      end = num_local_tiles * k_steps

      @pl.loop(0, slots)
      def _drain(i):
        position = end - slots + i

        @pl.when(position >= 0)
        def _wait():
          plgpu.barrier_wait(consumed.at[barrier_of(position)])

    @pl.when(wg < NUM_COMPUTE_WGS)
    def _compute_warpgroup():
      plgpu.set_max_registers(compute_registers(), action="increase")

      def compute_tile(owner, first_position, m_tile, n_tile):
        @pl.when(owner == wg)
        def _mine():
          n_slice = pl.ds(n_tile * tile_n, tile_n)
          if bias_gmem is not None:
            # Lands while the K loop runs.
            plgpu.copy_gmem_to_smem(bias_gmem.at[n_slice],
                                    column_vector_row(bias_smem, wg, config), bias_loaded.at[wg])

          @functools.partial(pl.run_scoped, acc_ref=accumulator((tile_m, tile_n)))
          def _acc_scope(acc_ref):
            def mma_step(kk, acc_ref):
              position = first_position + kk
              slot = slot_of(position)
              plgpu.barrier_wait(loaded.at[barrier_of(position, wg)])
              # A transposed operand's tile is read through a transposed view.
              lhs_tile, rhs_tile = lhs_smem.at[slot], rhs_smem.at[slot]
              plgpu.wgmma(acc_ref, lhs_tile.T if layout.transpose_lhs else lhs_tile,
                          rhs_tile.T if layout.transpose_rhs else rhs_tile)
              plgpu.wgmma_wait(in_flight)

              @pl.when(kk >= in_flight)
              def _release_done():
                plgpu.barrier_arrive(consumed.at[barrier_of(position - in_flight, wg)])
              return acc_ref

            lax.fori_loop(0, k_steps, mma_step, acc_ref)
            acc = acc_ref[...]  # Waits for the last wgmma.
            if in_flight:
              plgpu.barrier_arrive(consumed.at[barrier_of(first_position + k_steps - 1, wg)])
            if bias_gmem is not None:
              plgpu.barrier_wait(bias_loaded.at[wg])
            m_slice = pl.ds(m_tile * tile_m, tile_m)
            wg_derivative = (None if derivative_gmem is None
                             else derivative_gmem.at[m_slice, n_slice])
            store_epilogue((acc,), wg, out_gmem.at[m_slice, n_slice], out_smem, bias_smem,
                           config, epilogue, wg_derivative=wg_derivative)

      tile_loop(compute_tile)
      # The last tile's stores must be done reading SMEM before the kernel
      # exits (their GMEM writes complete on their own).
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
