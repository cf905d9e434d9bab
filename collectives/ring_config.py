"""The ring kernel's default config: what the ring needs of a warp-specialized matmul config.

The ring (`ring_matmul_sm90`) runs `emit_cooperative_matmul` once per shard and sends
on the LHS tiles its pipeline loads (`pipeline_callback`). So its config must
  * use the cooperative schedule and no split K: the tiles are sent from the
    cooperative pipeline's slots, and one block must load a tile's whole K
    range;
  * have a CTA tile that divides M_shard and N_shard: each sent LHS tile and
    each output tile is a whole CTA tile of one shard, never a masked ragged
    one;
  * fit SMEM with every slot held `SEND_DELAY_RELEASE` extra pipeline step.
`ring_matmul_sm90.check_ring_config` checks exactly that; `default_ring_config`
searches for a config that passes it. These constraints are the ring's, so
they live here and not in the plain matmul's heuristic (`pipelines.default_config`).
"""

from __future__ import annotations

import dataclasses
import math

from collectives import ring_matmul_sm90
from core import device_facts
from pipelines import MatmulDimension, TuningConfig
from pipelines.operands import MatmulProblem

# The warp-specialized tiles the ring chooses from, in order of preference:
# larger CTA tiles read fewer operand bytes per FLOP, and splitting M between
# the warpgroups is what the matmul heuristic's measured tiles do. The
# narrower ones (128x192, 128x64, 64x128) exist for shards the wide tiles do
# not divide (N_shard = 576 = 3 x 192 = 9 x 64). Every CTA tile_n is a multiple
# of 64, the 128-byte swizzle segment of 16-bit operands at tile_k = 64.
RING_TILES = (
    TuningConfig(tile_m=64, tile_n=256, wg_dimension=MatmulDimension.M),  # CTA 128x256.
    TuningConfig(tile_m=64, tile_n=192, wg_dimension=MatmulDimension.M),  # CTA 128x192.
    TuningConfig(tile_m=64, tile_n=128, wg_dimension=MatmulDimension.M),  # CTA 128x128.
    TuningConfig(tile_m=64, tile_n=128, wg_dimension=MatmulDimension.N),  # CTA 64x256.
    TuningConfig(tile_m=64, tile_n=64, wg_dimension=MatmulDimension.M),  # CTA 128x64.
    TuningConfig(tile_m=64, tile_n=64, wg_dimension=MatmulDimension.N),  # CTA 64x128.
)
# (operand stages, epilogue tile width), first that fits wins. Stages hide
# load latency, so the epilogue gives up width before the pipeline gives up
# stages, as in the matmul heuristic; at M_shard 512 the ring's 128x128 tiles
# ran 4% faster with 6 stages than with 4 (two H200s; docs/performance-log.md, "The ring
# on two H200s with the new defaults").
RING_STAGES = ((6, 64), (5, 64), (4, 128), (3, 128), (4, 64), (3, 64), (2, 64))


def divides(config: TuningConfig, problem: MatmulProblem) -> bool:
  """Whether `config`'s CTA tile divides the shard problem's M and N."""
  return problem.m % config.cta_tile_m == 0 and problem.n % config.cta_tile_n == 0


def _busiest_sm_elements(config: TuningConfig, problem: MatmulProblem) -> int:
  """Output elements the busiest SM computes per ring step: a proxy for its time."""
  num_tiles = (problem.m // config.cta_tile_m) * (problem.n // config.cta_tile_n)
  waves = -(-num_tiles // device_facts().sm_count)
  return waves * config.cta_tile_m * config.cta_tile_n


def default_ring_config(problem: MatmulProblem, out_dtype) -> TuningConfig | None:
  """A config the ring kernel can run on the local (M_shard, K, N_shard) problem.

  Of the `RING_TILES` that divide the shards, the one whose busiest SM
  computes the fewest output elements per step (the first of equals), with
  the deepest pipeline of `RING_STAGES` that passes the ring's check. That
  is the matmul heuristic's wave proxy without its per-tile costs, which
  were measured for three of these tiles only: in a full wave or more, ties
  keep the large tiles; below one, smaller tiles occupy more SMs.

  Args:
    problem: the local shard problem (M_shard, K, N_shard) and operand dtype.
    out_dtype: the output dtype (float16 or bfloat16).

  Returns:
    A cooperative `TuningConfig` with k_splits=1, or None where no tile
    divides the shards or none fits (then the ring cannot run this problem).
  """
  dividing = [tiles for tiles in RING_TILES if divides(tiles, problem)]
  # sorted() is stable: among equal costs, the earlier (larger) tile stays first.
  for tiles in sorted(dividing, key=lambda tiles: _busiest_sm_elements(tiles, problem)):
    for steps, epi_tile_n in RING_STAGES:
      config = dataclasses.replace(tiles, max_concurrent_steps=steps,
                                   epi_tile_n=math.gcd(epi_tile_n, tiles.tile_n))
      try:
        ring_matmul_sm90.check_ring_config(config, problem, out_dtype)
      except ValueError:
        continue  # Too deep for SMEM, or a K the tile cannot step through.
      return config
  return None
