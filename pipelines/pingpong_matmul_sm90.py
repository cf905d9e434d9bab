"""The ping-pong schedule of the warp-specialized persistent matmul (sm_90).

Same grid, tile order, warpgroups and epilogue as `ws_matmul_sm90`, but the
two compute warpgroups do not split a CTA tile: each block's tiles go to them
alternately (its local tile j to warpgroup j % 2), and each warpgroup
accumulates a whole (tile_m, tile_n) tile. The memory warpgroup fills one ring
of SMEM slots per compute warpgroup, in tile order, and it can only run
`max_concurrent_steps` loads ahead of the warpgroup it fills for. Nothing
else orders the two warpgroups, but once K spans more steps than a ring has
slots, the loads pace them: a warpgroup's K loop mostly runs while the other
one finishes its tile, so each epilogue (conversion, bias, activation, TMA
stores) runs under the other's wgmmas instead of leaving the tensor cores
idle, as the cooperative schedule does.

Each warpgroup waits only on its own ring's barriers. Mosaic GPU tracks a
barrier's phase per thread, so a barrier shared by warpgroups that wait on
alternate phases of it would lose track; two rings avoid that.
"""

from __future__ import annotations

import functools

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import accumulator, barrier, smem
from pipelines.config import NUM_COMPUTE_WGS, TuningConfig
from pipelines.epilogue import Epilogue, store_epilogue

# The copies that arrive on a slot's "loaded" barrier: the LHS and RHS tiles.
_COPIES_PER_SLOT = 2


def compute_registers(memory_registers: int) -> int:
  """Registers per thread left to each compute warpgroup (a multiple of 8, at most 256).

  A block has 64K registers, 512 per thread of one warpgroup; the memory
  warpgroup keeps `memory_registers` of them.
  """
  return min(256, (512 - memory_registers) // NUM_COMPUTE_WGS) // 8 * 8


def emit_pingpong_matmul(lhs_gmem, rhs_gmem, out_gmem, bias_gmem=None, *, config: TuningConfig,
                         epilogue: Epilogue = Epilogue(), sm_axis: str, wg_axis: str,
                         memory_registers: int) -> None:
  """Emits `out_gmem = epilogue(lhs_gmem @ rhs_gmem + bias_gmem)` inside a kernel.

  Must be called from a `plgpu.kernel` with grid axis `sm_axis` (at most one
  block per output tile) and three threads on axis `wg_axis`. Shapes as for
  `ws_matmul_sm90.emit_ws_matmul`: static; M and N may be ragged (TMA masks
  the edge tiles); K a multiple of `config.tile_k`.

  Args:
    lhs_gmem: (M, K) ref; rhs_gmem: (K, N) ref; out_gmem: (M, N) ref.
    bias_gmem: (N,) ref of the output dtype, or None.
    config: a `TuningConfig` with `schedule=Schedule.PINGPONG`.
    memory_registers: registers per thread the memory warpgroup keeps.
  """
  m, k = lhs_gmem.shape
  n = rhs_gmem.shape[1]
  dtype, out_dtype = lhs_gmem.dtype, out_gmem.dtype
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  m_tiles, n_tiles, k_steps = pl.cdiv(m, tile_m), pl.cdiv(n, tile_n), k // tile_k
  steps = min(config.max_concurrent_steps, k_steps)  # Slots per ring.
  # A step's slot goes back to the memory warpgroup once the wgmma reading it
  # is done. Leaving one wgmma in flight releases the previous step's slot,
  # which the next load may need only if the ring has two slots or more.
  in_flight = 1 if steps > 1 else 0

  scratch = dict(
      lhs_smem=smem((NUM_COMPUTE_WGS, steps, tile_m, tile_k), dtype, swizzled=True),
      rhs_smem=smem((NUM_COMPUTE_WGS, steps, tile_k, tile_n), dtype, swizzled=True),
      out_smem=smem((NUM_COMPUTE_WGS, config.epilogue_slots, config.epi_tile_m,
                     config.epi_tile_n), out_dtype, swizzled=True),
      # Slot s of warpgroup w's ring is barrier w * steps + s.
      loaded=barrier(num_barriers=NUM_COMPUTE_WGS * steps, num_arrivals=_COPIES_PER_SLOT),
      consumed=barrier(num_barriers=NUM_COMPUTE_WGS * steps),
  )
  if bias_gmem is not None:
    scratch["bias_smem"] = smem((NUM_COMPUTE_WGS, tile_n), out_dtype)
    scratch["bias_loaded"] = barrier(num_barriers=NUM_COMPUTE_WGS)

  def tile_loop(body):
    """Runs `body(ring, first_position, m_tile, n_tile)` for each of this block's tiles.

    `ring` is the compute warpgroup the tile belongs to; `first_position` is
    the index, in that ring, of the tile's first K step (slot = position %
    steps, and the slot's barriers complete once per position).
    """
    @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes=sm_axis)
    def _loop(loop_info: plgpu.NDLoopInfo):
      (linear,) = loop_info.index
      local = loop_info.local_index
      m_tile, n_tile = plgpu.planar_snake(linear, (m_tiles, n_tiles), config.grid_minor_dim,
                                          config.grid_tile_width)
      body(local % NUM_COMPUTE_WGS, (local // NUM_COMPUTE_WGS) * k_steps, m_tile, n_tile)

  def slot_of(ring, position):
    """The slot of `position` in `ring`, and the index of its barriers."""
    slot = lax.rem(position, steps)
    return slot, ring * steps + slot

  @functools.partial(pl.run_scoped, **scratch, collective_axes=wg_axis)
  def _scope(lhs_smem, rhs_smem, out_smem, loaded, consumed, bias_smem=None, bias_loaded=None):
    wg = lax.axis_index(wg_axis)

    @pl.when(wg == NUM_COMPUTE_WGS)
    def _memory_warpgroup():
      plgpu.set_max_registers(memory_registers, action="decrease")

      def load_tile(ring, first_position, m_tile, n_tile):
        @pl.loop(0, k_steps)
        def _load_step(kk):
          position = first_position + kk
          slot, bar = slot_of(ring, position)

          @pl.when(position >= steps)
          def _wait_for_release():  # Of the position `steps` before, same slot.
            plgpu.barrier_wait(consumed.at[bar])

          k_slice = pl.ds(kk * tile_k, tile_k)
          plgpu.copy_gmem_to_smem(lhs_gmem.at[pl.ds(m_tile * tile_m, tile_m), k_slice],
                                  lhs_smem.at[ring, slot], loaded.at[bar])
          plgpu.copy_gmem_to_smem(rhs_gmem.at[k_slice, pl.ds(n_tile * tile_n, tile_n)],
                                  rhs_smem.at[ring, slot], loaded.at[bar])

      tile_loop(load_tile)
      # Wait for the releases of each ring's last slots too, so that no
      # barrier is left mid-phase when the kernel ends.
      num_local_tiles = pl.cdiv(m_tiles * n_tiles - lax.axis_index(sm_axis),
                                lax.axis_size(sm_axis))
      for ring in range(NUM_COMPUTE_WGS):
        ring_tiles = (num_local_tiles - ring + NUM_COMPUTE_WGS - 1) // NUM_COMPUTE_WGS
        end = ring_tiles * k_steps

        @pl.loop(0, steps)
        def _drain(i, ring=ring, end=end):
          position = end - steps + i

          @pl.when(position >= 0)
          def _wait():
            plgpu.barrier_wait(consumed.at[slot_of(ring, position)[1]])

    @pl.when(wg < NUM_COMPUTE_WGS)
    def _compute_warpgroup():
      plgpu.set_max_registers(compute_registers(memory_registers), action="increase")

      def compute_tile(ring, first_position, m_tile, n_tile):
        @pl.when(ring == wg)
        def _mine():
          n_slice = pl.ds(n_tile * tile_n, tile_n)
          if bias_gmem is not None:
            # Lands while the K loop runs.
            plgpu.copy_gmem_to_smem(bias_gmem.at[n_slice], bias_smem.at[wg],
                                    bias_loaded.at[wg])

          @functools.partial(pl.run_scoped, acc_ref=accumulator((tile_m, tile_n)))
          def _acc_scope(acc_ref):
            def mma_step(kk, acc_ref):
              position = first_position + kk
              slot, bar = slot_of(wg, position)
              plgpu.barrier_wait(loaded.at[bar])
              plgpu.wgmma(acc_ref, lhs_smem.at[wg, slot], rhs_smem.at[wg, slot])
              plgpu.wgmma_wait(in_flight)

              @pl.when(kk >= in_flight)
              def _release_done():
                plgpu.barrier_arrive(consumed.at[slot_of(wg, position - in_flight)[1]])
              return acc_ref

            lax.fori_loop(0, k_steps, mma_step, acc_ref)
            acc = acc_ref[...]  # Waits for the last wgmma.
            if in_flight:
              plgpu.barrier_arrive(consumed.at[slot_of(wg, first_position + k_steps - 1)[1]])
            if bias_gmem is not None:
              plgpu.barrier_wait(bias_loaded.at[wg])
            wg_out = out_gmem.at[pl.ds(m_tile * tile_m, tile_m), n_slice]
            store_epilogue(acc, wg, wg_out, out_smem, bias_smem, config, epilogue)

      tile_loop(compute_tile)
      # The last tile's stores must be done reading SMEM before the kernel
      # exits (their GMEM writes complete on their own).
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
