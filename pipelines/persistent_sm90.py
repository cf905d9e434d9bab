"""What the warp-specialized matmul kernels share inside a kernel (sm_90).

Every such kernel (`cooperative_matmul_sm90`, `pingpong_matmul_sm90`, and the
ring all-gather matmul built on the cooperative one) runs one persistent
block per SM on grid axis `SM_AXIS` and three warpgroups on thread axis
`WG_AXIS`: two compute warpgroups and one memory warpgroup that only issues
TMA loads. The blocks walk the output tiles in a swizzled order
(`plgpu.planar_snake`), so consecutive tiles of neighbouring blocks share
operand panels in L2. With `TuningConfig.cluster_m` = 2 the grid axis counts
clusters of two blocks (`CLUSTER_AXIS`), which walk pairs of vertically
adjacent tiles.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pipelines.config import NUM_COMPUTE_WGS, TuningConfig

SM_AXIS = "sm"
# The blocks of a cluster (`TuningConfig.cluster_m`), which share RHS tiles by multicast.
CLUSTER_AXIS = "cluster"
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


def num_work_items(config: TuningConfig, m_tiles: int, n_tiles: int) -> int:
  """The work items `for_each_work_item` hands out: per block, or with
  `config.cluster_m` = 2 per cluster (a pair of vertically adjacent tiles)."""
  return config.k_splits * pl.cdiv(m_tiles, config.cluster_m) * n_tiles


def num_persistent_blocks(config: TuningConfig, work_items: int, sm_count: int) -> int:
  """The persistent grid's blocks for `work_items` (`num_work_items`) on
  `sm_count` SMs: a whole number of `config.cluster_m`-block clusters, one
  per work item at most, and at least one cluster even where `sm_count` is
  below a cluster's blocks (a grid capped for a test)."""
  clusters = max(1, min(sm_count // config.cluster_m, work_items))
  return clusters * config.cluster_m


def for_each_work_item(config: TuningConfig, m_tiles: int, n_tiles: int,
                       body: WorkItemBody) -> None:
  """Runs `body` for each of this block's work items, in the swizzled tile order.

  A work item is an output tile, or with `config.k_splits` > 1 a (K range,
  output tile) pair. The K range varies slowest, so blocks that run at the
  same time share operand panels in L2. `local_index` counts this block's
  work items from 0.

  With `config.cluster_m` = 2 the clusters walk pairs of M tiles, and the
  block of index c in its cluster takes M tile 2 * pair + c: both blocks run
  the same number of work items, in step, as the multicast loads they share
  need. With an odd number of M tiles the last pair's second tile is
  `m_tiles`, past the output, which `body` must not store.
  """
  pairs = pl.cdiv(m_tiles, config.cluster_m)
  num_tiles = pairs * n_tiles

  @plgpu.nd_loop((num_work_items(config, m_tiles, n_tiles),), collective_axes=SM_AXIS)
  def _loop(loop_info: plgpu.NDLoopInfo):
    (linear,) = loop_info.index
    split, tile = divmod(linear, num_tiles) if config.k_splits > 1 else (0, linear)
    m_tile, n_tile = plgpu.planar_snake(tile, (pairs, n_tiles), config.grid_minor_dim,
                                        config.grid_tile_width)
    if config.cluster_m > 1:
      m_tile = m_tile * config.cluster_m + lax.axis_index(CLUSTER_AXIS)
    body(split, m_tile, n_tile, loop_info.local_index)
