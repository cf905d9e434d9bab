"""`group_tiles` against a row-by-row account of which group owns each row."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from core import testing
from pipelines.group_schedule import ROW_ALIGNMENT, group_tiles, max_group_tiles

TILE_M = 64


def owners(group_sizes, m):
  """The group of each of m rows (len(group_sizes) past the groups), row by row."""
  owner, row = np.full(m, len(group_sizes)), 0
  for g, size in enumerate(group_sizes):
    take = max(0, min(size, m - row))
    owner[row:row + take] = g
    row += take
  return owner


def loops(jaxpr):
  """The names of the loop primitives in `jaxpr` and the jaxprs inside it."""
  return [eqn.primitive.name for eqn in testing.equations(jaxpr)
          if eqn.primitive.name in ("scan", "while")]


class GroupTilesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("uneven", [100, 3, 0, 64, 129], 296),
      ("empty_groups", [0, 0, 200, 0], 200),
      ("one_group_holds_every_row", [0, 300, 0], 300),
      ("single_rows", [1, 1, 1, 1, 1], 5),
      ("rows_past_the_groups", [10, 20], 500),
      ("sizes_past_m", [100, 100, 100], 150),
      ("negative_size", [-5, 40], 40),
      ("tile_multiples", [64, 128, 64], 256),
      ("no_rows", [0, 0], 0),
      ("starts_off_8_rows", [3, 61, 70, 5, 1], 140),
      # Many groups of random sizes, some empty, summing to less than M.
      ("many_groups", np.random.default_rng(7).integers(0, 40, 300).tolist(), 6400),
  )
  def test_every_row_once_and_no_tile_mixes_groups(self, group_sizes, m):
    tiles = group_tiles(jnp.array(group_sizes, jnp.int32), m, TILE_M)
    group, start, rows = (np.asarray(a) for a in (tiles.group, tiles.row_start, tiles.rows))
    self.assertEqual(group.shape, (max_group_tiles(m, len(group_sizes), TILE_M),))
    covered = np.zeros(m, int)
    want = owners(group_sizes, m)
    for g, s, r in zip(group, start, rows, strict=True):
      self.assertBetween(r, 0, TILE_M)
      if r:
        covered[s:s + r] += 1
        np.testing.assert_array_equal(want[s:s + r], g, f"tile at row {s} of {r} rows")
    np.testing.assert_array_equal(covered, 1)
    # The used entries come first; each tile lies in a window of TILE_M rows
    # from a multiple of 8, and a group's tiles are consecutive windows.
    used = rows > 0
    self.assertTrue(used[:used.sum()].all(), rows)
    window = start - start % ROW_ALIGNMENT
    self.assertTrue(np.all(start[used] + rows[used] <= window[used] + TILE_M))
    for g in np.unique(group[used]):
      mine = window[used & (group == g)]
      np.testing.assert_array_equal(np.diff(mine), TILE_M, f"group {g}: {mine}")

  def test_one_program_for_every_routing(self):
    traces = []

    @jax.jit
    def tiles(group_sizes):
      traces.append(None)
      return group_tiles(group_sizes, 256, TILE_M).rows

    for sizes in ([256, 0, 0], [1, 2, 253], [0, 0, 0]):
      tiles(jnp.array(sizes, jnp.int32))
    self.assertLen(traces, 1)

  def test_table_has_no_loop(self):
    # On the GPU XLA may run a loop as kernels per iteration, ahead of every
    # grouped matmul; the table must be a few fused ops, whatever G is.
    jaxpr = jax.make_jaxpr(lambda sizes: dataclasses.astuple(group_tiles(sizes, 4096, TILE_M)))(
        jnp.ones((64,), jnp.int32))
    self.assertEmpty(sorted(loops(jaxpr.jaxpr)))

  def test_tile_m_must_be_whole_windows(self):
    with self.assertRaisesRegex(ValueError, r"tile_m=60 must be a multiple of 8"):
      group_tiles(jnp.ones((2,), jnp.int32), 8, 60)

  def test_group_sizes_must_be_a_vector(self):
    with self.assertRaisesRegex(ValueError, r"group_sizes must be 1-D \(G,\)"):
      group_tiles(jnp.ones((2, 2), jnp.int32), 8, TILE_M)


if __name__ == "__main__":
  absltest.main()
