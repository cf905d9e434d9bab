"""The `emit_pipeline` matmul (sm_90): the kernel body.

A parallel grid of output tiles (axes "m" and "n"), a pipelined K loop.

Each block is one warpgroup that owns a (tile_m, tile_n) float32 accumulator
in registers. `plgpu.emit_pipeline` streams (tile_m, tile_k) and (tile_k,
tile_n) operand tiles into `max_concurrent_steps` SMEM slots with TMA; each step
issues a wgmma and leaves `delay_release` of them in flight. The result is
cast, staged in SMEM and stored with one TMA copy.

M and N need not be multiples of the tile: TMA zero-fills the out-of-bounds
part of a loaded tile and clips the out-of-bounds part of a stored one, so edge
tiles are masked by the hardware. The wrapper (`kernel_call.pipelined_matmul`)
pads M off a multiple of 8 and N off the swizzle width (64 elements for
16-bit), because TMA's GMEM tiling needs those multiples, except where a
tile is one swizzle segment wide and is copied as a 2D box
(`operands.tma_sizes`).
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import accumulator, store_tile, tile_transforms
from pipelines.config import PipelinedConfig

M_AXIS, N_AXIS = "m", "n"


def emit_pipelined_matmul(lhs_gmem, rhs_gmem, out_gmem, *, config: PipelinedConfig) -> None:
  """Emits this block's (tile_m, tile_n) tile of `out_gmem = lhs_gmem @ rhs_gmem`.

  Must be called from a kernel with grid axes `M_AXIS` and `N_AXIS` over
  the output tiles and one warpgroup per block. lhs_gmem (M, K), rhs_gmem
  (K, N), out_gmem (M, N); K a multiple of `config.tile_k`.
  """
  k_steps = lhs_gmem.shape[1] // config.tile_k
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  m_slice = pl.ds(lax.axis_index(M_AXIS) * tile_m, tile_m)
  n_slice = pl.ds(lax.axis_index(N_AXIS) * tile_n, tile_n)
  dtype = lhs_gmem.dtype

  def accumulate(acc_ref):
    def step(_, lhs_smem, rhs_smem):
      plgpu.wgmma(acc_ref, lhs_smem, rhs_smem)
      # Keeping `delay_release` wgmmas in flight is safe because the pipeline
      # holds their SMEM slots for that many extra steps before refilling.
      plgpu.wgmma_wait(config.delay_release)

    plgpu.emit_pipeline(
        step,
        grid=(k_steps,),
        in_specs=[
            config.pipeline.block_spec((tile_m, tile_k), lambda k: (0, k),
                                       transforms=tile_transforms(tile_k, dtype)),
            config.pipeline.block_spec((tile_k, tile_n), lambda k: (k, 0),
                                       transforms=tile_transforms(tile_n, dtype)),
        ],
        max_concurrent_steps=config.max_concurrent_steps,
    )(lhs_gmem.at[m_slice, :], rhs_gmem.at[:, n_slice])
    return acc_ref[...]  # Reading the accumulator waits for all wgmmas.

  acc = pl.run_scoped(accumulate, accumulator((tile_m, tile_n)))
  store_tile(acc, out_gmem.at[m_slice, n_slice])
