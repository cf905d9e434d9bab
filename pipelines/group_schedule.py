"""Which rows each M tile of a grouped matmul (`ragged_dot`) covers, from the group sizes.

`jax.lax.ragged_dot(lhs (M, K), rhs (G, K, N), group_sizes (G,))` multiplies
the rows of group g (consecutive, in order) by rhs[g]. A kernel for it must
never let one tile of rows mix two groups' weights, and the group sizes are
data (a router's output), so the tiles cannot be fixed at trace time without
recompiling per routing. This module lays the tiles out on the device: each
group's rows are cut into tiles of `tile_m` rows, and the rows past the
groups (where the sizes sum to less than M) form one more group, whose tiles
the kernel fills with zeros. Their count is at most `max_group_tiles(m, G,
tile_m)`, a static bound, so the table has static shapes: a few small XLA
ops before the kernel, which reads its entry per work item.

Every tile lies in a window of `tile_m` rows that starts on a multiple of
`ROW_ALIGNMENT` (8): Mosaic GPU copies a swizzled SMEM tile to and from
GMEM in tiles of 8 rows, so a kernel can only load and store its LHS and
output tiles at such rows. A group's tiles are the windows from the aligned
row at or below its first row; only its first tile may start inside its
window (at most 7 rows in) and only its last may end before it.

The weight gradient of a grouped matmul contracts over each group's rows
instead (a ragged K): its kernel needs only each group's first and last row
(`group_rows`), and reads each group's rows from the aligned row at or below
its first, zeroing the rows of other groups in its first and last K step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# The rows a tile's window starts on a multiple of.
ROW_ALIGNMENT = 8


@dataclasses.dataclass(frozen=True)
class GroupTiles:
  """The row tiles of a grouped matmul, `max_group_tiles(...)` entries each.

  Arrays outside a kernel; inside one, GMEM refs to them.

  Attributes:
    group: (T,) int32, the group whose weights entry t multiplies; G for the
      rows past the groups (zeros), and for the entries past the last tile.
    row_start: (T,) int32, the tile's first row of lhs and of the output (M or
      more for the entries past the last tile). Its window of tile_m rows
      starts at `row_start - row_start % ROW_ALIGNMENT`.
    rows: (T,) int32, how many rows from `row_start` the tile owns (1 to
      tile_m, all inside its window; 0 for the entries past the last tile,
      which do nothing).
  """

  group: jax.Array
  row_start: jax.Array
  rows: jax.Array


@dataclasses.dataclass(frozen=True)
class GroupRows:
  """The rows of each group of a grouped matmul, [start[g], end[g]).

  Arrays outside a kernel; inside one, GMEM refs to them.

  Attributes:
    start: (G,) int32, the group's first row.
    end: (G,) int32, one past its last row (start for an empty group).
  """

  start: jax.Array
  end: jax.Array


def group_rows(group_sizes: jax.Array, m: int) -> GroupRows:
  """The rows of `m` rows grouped by `group_sizes` (G,), on the device.

  Sizes are taken as int32 and negative ones as 0; where they sum to more
  than `m`, the groups are cut at row m (as in `group_tiles`).
  """
  if group_sizes.ndim != 1:
    raise ValueError(f"group_sizes must be 1-D (G,), got shape {group_sizes.shape}")
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return GroupRows(start=starts.astype(jnp.int32), end=ends.astype(jnp.int32))


def max_group_tiles(m: int, num_groups: int, tile_m: int) -> int:
  """A bound on the tiles `group_tiles` lays out for any group sizes.

  A group of r rows whose window starts up to 7 rows before its first row
  takes at most (r + 7) / tile_m + 1 tiles; summed over the G groups and
  the rows past them, (M + 7 (G + 1)) / tile_m + G + 1.
  """
  groups = num_groups + 1
  return -(-(m + (ROW_ALIGNMENT - 1) * groups) // tile_m) + groups


def group_tiles(group_sizes: jax.Array, m: int, tile_m: int) -> GroupTiles:
  """The row tiles of `m` rows grouped by `group_sizes` (G,), on the device.

  Sizes are taken as int32 and negative ones as 0; where they sum to more than
  `m`, the groups are cut at row m (the rows that do not exist are dropped
  from the last groups), as nothing past M can be read or written.
  `tile_m` must be a multiple of `ROW_ALIGNMENT`.
  """
  if tile_m % ROW_ALIGNMENT:
    raise ValueError(f"tile_m={tile_m} must be a multiple of {ROW_ALIGNMENT}")
  num_groups = group_sizes.shape[0]
  # The rows past the groups, as group G.
  ends = jnp.append(group_rows(group_sizes, m).end, jnp.int32(m))
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  windows_start = starts - starts % ROW_ALIGNMENT
  tiles = jnp.where(ends > starts, -(-(ends - windows_start) // tile_m), 0)
  tiles_end = jnp.cumsum(tiles)
  t = jnp.arange(max_group_tiles(m, num_groups, tile_m), dtype=jnp.int32)
  # The group of entry t: the first whose tiles end past t (G for the rest).
  # Counted by comparing every entry with every group's end, which XLA fuses
  # into one kernel: the default binary search is a loop, which XLA runs on
  # the GPU as small kernels per iteration (by default it unrolls only loops
  # that hold a collective), before every call.
  group = jnp.minimum(jnp.searchsorted(tiles_end, t, side="right", method="compare_all"),
                      num_groups)
  window = windows_start[group] + (t - (tiles_end[group] - tiles[group])) * tile_m
  row_start = jnp.maximum(window, starts[group])
  rows = jnp.clip(jnp.minimum(ends[group], window + tile_m) - row_start, 0, tile_m)
  return GroupTiles(group=group.astype(jnp.int32), row_start=row_start.astype(jnp.int32),
                    rows=rows.astype(jnp.int32))
