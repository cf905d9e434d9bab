"""What the warp-specialized matmul kernels share inside a kernel (sm_90).

Every such kernel (`cooperative_matmul_sm90`, `pingpong_matmul_sm90`, and the
ring all-gather matmul built on the cooperative one) runs one persistent
block per SM on grid axis `SM_AXIS` and three warpgroups on thread axis
`WG_AXIS`: two compute warpgroups and one memory warpgroup that only issues
TMA loads. The blocks walk the output tiles in a swizzled order
(`plgpu.planar_snake`), so consecutive tiles of neighbouring blocks share
operand panels in L2.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pipelines.config import NUM_COMPUTE_WGS, TuningConfig

SM_AXIS = "sm"
WG_AXIS = "wg"
# Registers the memory warpgroup keeps; the compute warpgroups get the rest.
MEMORY_WG_REGISTERS = 40


def compute_registers(memory_registers: int = MEMORY_WG_REGISTERS) -> int:
  """Registers per thread left to each compute warpgroup (a multiple of 8, at most 256).

  A block has 64K registers, 512 per thread of one warpgroup; the memory
  warpgroup keeps `memory_registers` of them.
  """
  return min(256, (512 - memory_registers) // NUM_COMPUTE_WGS) // 8 * 8


# body(split, m_tile, n_tile, local_index): one work item of this block.
WorkItemBody = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], None]


def for_each_work_item(config: TuningConfig, m_tiles: int, n_tiles: int,
                       body: WorkItemBody) -> None:
  """Runs `body` for each of this block's work items, in the swizzled tile order.

  A work item is an output tile, or with `config.k_splits` > 1 a (K range,
  output tile) pair. The K range varies slowest, so blocks that run at the
  same time share operand panels in L2. `local_index` counts this block's
  work items from 0.
  """
  num_tiles = m_tiles * n_tiles

  @plgpu.nd_loop((config.k_splits * num_tiles,), collective_axes=SM_AXIS)
  def _loop(loop_info: plgpu.NDLoopInfo):
    (linear,) = loop_info.index
    split, tile = divmod(linear, num_tiles) if config.k_splits > 1 else (0, linear)
    m_tile, n_tile = plgpu.planar_snake(tile, (m_tiles, n_tiles), config.grid_minor_dim,
                                        config.grid_tile_width)
    body(split, m_tile, n_tile, loop_info.local_index)
