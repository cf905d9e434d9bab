"""`default_config`: the warp-specialized matmul's config without tuning.

Every constant of the heuristic is here, each with where it was measured:
the section of docs/performance-log.md, or the record in perf/, named beside
it. It chooses among a few CTA tiles, the ping-pong schedule for
short K, pipeline depth, epilogue tiles and a split of K, modelling compute
and HBM time where the output has too few tiles to fill the SMs.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from core import device_facts
from core.memory import SWIZZLE_BYTES
from pipelines import kernel_call, operands
from pipelines.config import (
  FP8_DTYPE,
  FP8_SCALE_BLOCK,
  Fp8Config,
  MatmulDimension,
  Schedule,
  TuningConfig,
  check_swizzle,
  k_range_steps,
  operand_swizzle,
)

# The 128x192 CTA tile's relative time per multiply-add: from 0.94 to 1.07
# in two problems where it left fewer SMs idle in the last wave than 128x256
# (5000x4096x2560 and 1000x4096x3008 on an H200; docs/performance-log.md, "Why the
# pads existed, and what was changed"); the upper
# half of that range, so that it wins only by wave count.
_TILE_192_COST = 1.05
# The tiles the heuristic chooses from, largest CTA tile first: two 64x256,
# 64x192, 64x128 or 64x64 warpgroup tiles make CTA tiles of 128x256,
# 128x192, 128x128 and 64x128. Each comes with the relative time of one of
# its multiply-adds on an H200 (smaller tiles reread more operand bytes per
# FLOP): 1.1 from the split-K sweeps at equal work per SM; 1.5 from
# 256x8192x4096, where the unsplit 64x128 tile ran 14% slower than 128x256
# tiles in 4 splits. Stages, epilogue tiles and splits are filled in by
# `default_config`.
_SMALL_TILE = TuningConfig(tile_m=64, tile_n=64, wg_dimension=MatmulDimension.N)
_HEURISTIC_TILES = (
    (TuningConfig(tile_m=64, tile_n=256, wg_dimension=MatmulDimension.M), 1.0),
    (TuningConfig(tile_m=64, tile_n=192, wg_dimension=MatmulDimension.M), _TILE_192_COST),
    (TuningConfig(tile_m=64, tile_n=128, wg_dimension=MatmulDimension.M), 1.1),
    (_SMALL_TILE, 1.5),
)
# Decode-size M also gets a 64x256 CTA tile (two 64x128 warpgroup tiles
# along N), whose wider RHS stages keep more bytes in flight. Its relative
# cost per multiply-add lies between the 128x128 and 128x256 tiles' costs.
# In K ranges it is offered up to `_DECODE_SPLIT_MAX_M` rows: at 1x8192x8192
# and 16x8192x8192 it ran 13% and 9% faster than 64x128 tiles, in 4 K ranges
# against 2; at M = 24-48 in ranges it gained 2-3% on two shapes and lost
# 3-10% on three, for a reason not found (docs/performance-log.md, "The decode
# tile's bounds: which M, which K ranges").
# Unsplit, it is offered up to `_DECODE_MAX_M` rows: with weights wide enough
# for its tiles to fill most of the SMs (N = 10240-128256 at M = 1-64, models
# suite's fit half, bf16), it streamed them 1.08-1.18x faster than unsplit
# 64x128 tiles (16x8192x57344: 221 against 252 us, jnp.dot 209; 64x4096x28672:
# 56.7 against 62.5, jnp.dot 56.6; docs/performance-log.md, "Decode and LoRA
# sizes of the models suite's fit half").
_DECODE_TILE = (TuningConfig(tile_m=64, tile_n=128, wg_dimension=MatmulDimension.N), 1.2)
_DECODE_SPLIT_MAX_M = 16
_DECODE_MAX_M = 64
# Decode-size M also gets a 64x512 CTA tile (two 64x256 warpgroup tiles along
# N; two stages fit), unsplit, at the decode tile's cost: it streams twice the
# weight columns a work item, so a weight that 64x256 tiles stream in one to
# two waves may fit in one (`_estimated_time_us` charges such a stream two
# whole waves). On an H200 (bf16; perf/2026-12-04-h200-wide-decode-tile-probe.json),
# where its work items fit in one wave and the heuristic's 64x256 or 64x128
# tiles' did not, it ran 1.08x faster at 16x8192x57344 (fit half) and
# 1.12-1.18x at 16x6144x49152, 32x4096x45056 and 8x7168x36864 (no suite);
# where both fit in one wave it ran 1.16-1.28x slower (1x3072x32064,
# 16x4096x28672, 64x4096x28672, 64x4096x32000: half as many SMs stream), and
# where neither does, 0.92-1.02x (docs/performance-log.md, "A 64x512 decode tile, and
# streams charged whole waves").
_WIDE_DECODE_TILE = (TuningConfig(tile_m=64, tile_n=256, wg_dimension=MatmulDimension.N), 1.2)
# The (CTA rows, CTA columns) of the two decode tiles (`_hbm_bytes_per_us`).
_DECODE_CTA_TILES = frozenset((tiles.cta_tile_m, tiles.cta_tile_n)
                              for tiles, _ in (_DECODE_TILE, _WIDE_DECODE_TILE))
# Tiles whose (K, N) RHS tiles are one segment wide (each warpgroup of the
# 64x128 tile loads its own 64 columns, `TuningConfig.rhs_tiles`) read that
# RHS as boxes in place at any N on 16 bytes (`operands.tma_sizes`), where
# wider tiles pad an N off 64 columns (N = 3000, 1000, 4040), a copy of the
# whole RHS. Where the 64x128 tile reads it in place and M is at most
# `_IN_PLACE_RHS_MAX_M`, the candidates' times include their copy
# (`operands.copy_us`), and a 128x64 CTA tile (two 64x64 warpgroup tiles
# along M) is weighed too, at the 64x128 tile's cost. Beyond one row of
# 64x128 tiles it is preferred among equal times: each row of CTA tiles
# rereads the RHS, and the 128x64 tile has half as many. On an H200 (f16):
# in place, the heuristic ran 1.1-2.25x faster than with the padded tiles on
# 16 problems of M = 1-256 (128x8192x3000: 24.4 against 51.6 us); at
# M = 100-256 the 128x64 tile ran 0-8% faster than the 64x128 one on seven
# problems, at M = 1-64 the 64x128 one 1.1-2.0x faster than the 128x64 one
# on seven, whose second warpgroup computes rows past M (docs/performance-log.md, "Small
# M with a ragged (K, N) RHS: 128x64 tiles read it in place" and "Each warpgroup's own
# RHS tile").
_TILE_128X64 = TuningConfig(tile_m=64, tile_n=64, wg_dimension=MatmulDimension.M)
_IN_PLACE_RHS_TILE = (_TILE_128X64, 1.5)
_IN_PLACE_RHS_MAX_M = 256
# Outputs at most one 64-column segment wide (LoRA projections to a low rank,
# MoE routers: N <= `_NARROW_MAX_N`) stream the LHS and compute little, so
# every tile wider than N multiplies zero columns and pads the RHS and the
# output. They take CTA tiles 64 columns wide instead: 128x64 (two 64x64
# warpgroup tiles along M), or where M fits 64 rows, 64x64 (two 64x32 tiles
# along N), since a 128-row tile's second warpgroup would compute rows past
# M. Their splits of K come from `_estimated_time_us` at a relative cost of
# 1.0 per multiply-add (the work is HBM-bound; the fitted value) in ranges as
# short as 256 (4 K steps), with 8 operand stages. On an H200 (f16, 18
# problems of N = 16-64, M = 64-16384, K = 1024-14336; docs/performance-log.md,
# "Outputs at most 64 columns wide: 64-column CTA tiles") that
# picks, on each, a split within 8% of the fastest one measured for its tile;
# 4096x4096x64 in 4 ranges: 9.6 us against 13.5 for the 128x128 tiles the
# model chose before (jnp.dot: 12.7); 64x4096x64 in 16 ranges of 64x64
# tiles: 3.6 us against 6.7 (jnp.dot: 3.2).
_NARROW_MAX_N = 64
_NARROW_TILE = (_TILE_128X64, 1.0)
# Outputs at most 16 columns wide with the RHS stored (N, K) (NT, TT) take
# 128x16 CTA tiles in the 128x64 tile's split of K. Such an RHS's tiles are
# whole 128-byte swizzled rows along K at any width, so a 16-column tile
# spares the 48 zero-filled rows a 64-column one loads and multiplies. With a
# (K, N) RHS the narrower tile means a narrower swizzle, and 128x16 tiles ran
# up to 3.6x slower (docs/performance-log.md, "N <= 16: narrower CTA tiles").
# On an H100 (bf16 and f16, 3 rounds of 20 calls; "The FP8 quantization
# kernels, two-block steps and the N <= 16 tile rule on a GPU") the 128x16
# tile ran 1.01-1.46x faster than the 128x64 one on all 12 problem-dtypes
# measured: 4096x4096x8 NT 0.92-0.95x jnp.dot (fit half, 0.67-0.69x before),
# 4096x18944x16 NT 1.08x (check half, 1.01x before).
_NARROW_TRANSPOSED_RHS_MAX_N = 16
_NARROW_TRANSPOSED_RHS_TILE = TuningConfig(tile_m=64, tile_n=16, epi_tile_n=16,
                                           wg_dimension=MatmulDimension.M)
# Such outputs over an RHS stored (K, N) (LoRA A's product x @ A and its
# weight gradient) have XLA transpose the RHS first
# (`TuningConfig.transpose_rhs_first`), a copy of at most 16 x K elements,
# and take the (N, K) RHS's config above, where M is over
# `_TRANSPOSE_RHS_FIRST_MIN_M`. On an H100 (bf16 and f16, 2 rounds of 20
# calls, perf/2026-12-05-h100-transpose-rhs-first-ab.json) that ran
# 1.23-1.31x faster at 4096x4096x8 NN and TN and 4096x4096x16 NN (fit half
# and narrow suite), 1.01-1.39x on six problems of no suite of 1000-65536
# rows, and 0.92-0.93x at 256x4096x16, where the copy's microsecond or two is
# a fifth of the product's time; the A/B of the landed rule
# (perf/2026-12-06-h100-narrow-rules-landed-ab.json) had 512x4096x16 0.97x,
# so the rule starts past 512 rows.
_TRANSPOSE_RHS_FIRST_MIN_M = 512
# Decode-size products (M <= 16 rows) whose weights are
# at most `_TRANSPOSED_DECODE_MAX_N` wide run as their transpose
# (`TuningConfig.swap_operands`): out.T = W.T @ x.T, the activations an (N', K)
# RHS under the 16-column tile above, in float32, transposed by XLA in the
# pass that sums the K ranges. As the LHS, their 64-row tiles reach past M,
# and the TMA loads of those rows were slow: the kernel of 16x4096x4096 took
# 11.0 us, 7.5 us with the LHS zero-padded to 64 rows (H100). On an H100 (bf16,
# 2 rounds of 20 calls; docs/performance-log.md, "Decode as its transpose"), on
# the fit half and problems of no suite, the transpose ran 1.01-1.37x faster
# on 9 of the 11 such problems up to N = 8192 (1x4096x4096: 0.68x -> 0.93x
# jnp.dot; 16x3072x3072: 0.81x -> 1.11x), 0.4% and 2.3% slower on
# 16x4096x6144 and 1x8192x3072, and slower on 8 of 10 wider ones (its
# 128-row tiles along N fall into part-empty waves: 16x4096x28672 0.96x -> 0.90x).
# A (K, M) LHS (LoRA B's weight gradient, M = its rank) is transposed by XLA
# first, so its rows are an (N', K) RHS too: read as stored, a (K, N') RHS of
# 16 columns is rows of 32 bytes in a narrow swizzle, and ran 0.70x jnp.dot at
# 16x4096x4096 (H100). With the copy, on an H100 (2 rounds of 20 calls;
# docs/performance-log.md, "The check half on an H100, and a (K, M) LHS at
# decode size"), 8x4096x4096 TN (fit half) ran 0.56-0.58x -> 0.79-0.80x
# jnp.dot, and 13 of 16 problem-dtypes of no suite (TN, TT, M = 1-16) ran
# 1.01-1.22x faster; 8x14336x4096 0.8-2.7% slower, 16x8192x8192 0.6% slower
# in bf16.
_TRANSPOSED_DECODE_MAX_N = 8192
_NARROW_DECODE_TILE = (TuningConfig(tile_m=64, tile_n=32, epi_tile_n=32,
                                    wg_dimension=MatmulDimension.N), 1.0)
_MIN_SPLIT_K_NARROW = 256
_NARROW_STAGES = (8, 6, 4, 3, 2)
# A warpgroup tile's main loop, in one-segment RHS tiles (`TuningConfig.rhs_tile_n`),
# relative to one RHS tile of its width, by the number of segments: each is a
# wgmma of its own. Not because each rereads the LHS tile from SMEM: loading
# that tile into registers once a K step for all four segments left 8192x4096x3000
# and 8192x4096x14000 within 0.3% on an H100 (docs/performance-log.md, "The
# LHS tile in registers for several wgmmas"). On an H200: 1.6-2%
# for 128x192 CTA tiles on aligned rows (1000x4096x3072); 128x256 ones in place
# ran 3.5% slower than with a 16 us pad of the RHS at 8192x4096x3000, 1.8% at
# 8192x8192x4040 (bf16), and 2% faster at 4096x4096x4040 and 4096x1024x4040,
# where the pad is 13-16% of the modelled main loop, not 6%: about 10%
# (docs/performance-log.md, "One-segment RHS tiles in 2-CTA clusters"). 128x128 tiles
# were not measured on aligned rows; they gained
# 10-19% where a pad or a narrower swizzle was 20-32% of the main loop.
_ONE_SEGMENT_RHS_TILES_COST = {2: 1.02, 3: 1.02, 4: 1.10}
# `_estimated_time_us` models a problem with too few tiles to fill the SMs, on
# an H200. Its constants were fitted to the split-K and small-output sweeps
# (docs/performance-log.md, "Small outputs bound by HBM: the heuristic now counts
# bytes"): on each of the 13 problems measured, it chooses the
# fastest config measured, and so do nearby values of the constants.
# One SM's multiply-adds per microsecond in 128x256 tiles (800 TFLOP/s).
_SM_MACS_PER_US = 3.03e6
# Each work item's pipeline fill and drain, and its epilogue.
_WORK_ITEM_US = 2.0
# HBM bytes per microsecond, fitted: above the 4.8e6 peak, since the 3-norm
# below adds time wherever compute and HBM times are close, as in every
# problem measured.
_HBM_BYTES_PER_US = 5.0e6
# At decode-size M (at most `_DECODE_SPLIT_MAX_M` rows), where the time is the
# weights' stream, every CTA tile but the decode tile (`_DECODE_TILE`) streams
# them at this share of `_HBM_BYTES_PER_US`. On an H200 at M = 1-16 with 64-128
# SMs holding work, 64x256 decode tiles read the weights at 3.4-4.3 TB/s
# (median 3.9), 64x128 tiles at 2.8-3.9 (median 3.3), 128-row tiles at
# 2.5-3.1. 16x8192x10240: 80 work items of 2.1 MB each in both, 43.5 us in
# 64x256 tiles in 2 K ranges, 51.0-52.5 in unsplit 64x128 tiles, which the
# model had level (43.7 against 43.4); 16x4096x14336: 31.3 us in unsplit
# 64x256 tiles, 35.2 in 64x128 ones, 39.9-47.3 in 128-row ones. Not one SM's
# limit: 64x128 tiles streamed 70 GB/s per SM with 32 SMs holding work
# (16x14336x4096), 41 with 80 (16x8192x10240); the chip's rate is what drops.
# At M = 64 they were not slow (64x8192x8192 unsplit: 4.0 TB/s on 64 SMs,
# against 3.2 at M = 16 in the same run), so the share stops at 16 rows.
# Fitted on the models suite's fit half and the decode probes, M = 1-64
# (docs/performance-log.md, "Decode and LoRA sizes of the models suite's fit
# half" and "Shorter split-K ranges and a decode tile", and their records in
# perf/): 0.8 has the least log error over the 165 options measured that the
# model weighs (rms 0.15 -> 0.13), and with it the model ranks first the
# fastest option measured, or one within 2% of it, on 27 of the 29 sets of
# options measured together (25 before), as with any share from 0.7 to 0.85;
# fitted on either day's records alone (2026-12-01, 2026-12-03), the least log
# error falls at 0.83 and 0.77.
_DECODE_OTHER_TILES_HBM_SHARE = 0.8
# The loads overlap the wgmmas, but not perfectly: the kernel's time is the
# 3-norm of the compute and HBM times (between their sum and their max).
_OVERLAP_NORM = 3
# The XLA fusion that sums split partials: launch, and its reads of the
# partials, which it mostly finds in L2 right after the kernel wrote them.
_SPLIT_SUM_US = 4.0
_SPLIT_SUM_BYTES_PER_US = 16e6
# Shortest K range a split gets, by CTA tile width: below it the fill and
# drain of each range's pipeline dominate. Tiles wider than 128 columns fill
# pipelines of large RHS stages: in 1024-long ranges the 128x256 tile ran
# 13-17% slower than 128x128 tiles in 2048-long ones (512x4096x2048,
# 512x8192x1024, 1024x8192x512), the 64x256 decode tile 3-7% slower than in
# 2048-long ones (1x8192x4096, 16x8192x4096). Tiles up to 128 wide did well
# in ranges 512 long, which fill the SMs where the output has few tiles:
# 1.16-1.40x cuBLAS at 256x16384x256, 128x32768x128, 333x2048x1111,
# 256x2048x1024 and 64x2048x2048, where 2048-long ranges ran at 0.72-0.99x
# (docs/performance-log.md, "The change, and an A/B of the heuristics in one run"). The
# 128x192 tile (4 stages) ran well in 1024-long
# ranges: on the 16 problems where allowing them changed the choice, 1.03x
# faster (geometric mean; 333x4096x2080: 16.9 against 25.3 us; 100x8192x2080:
# 14.1 against 17.9), and at most 2.4% slower on one
# (perf/2026-12-01-h200-heuristic-narrow-swizzle-ab.json).
_MIN_SPLIT_K_WIDE_TILE = 2048
_MIN_SPLIT_K_192_TILE = 1024
_MIN_SPLIT_K = 512
# The ping-pong schedule's 128x192 tile, which hides each tile's epilogue
# under the other warpgroup's K loop. Against the cooperative 128x256 tile on
# an H200: at K = 1024-2048, where the epilogue is a large share of a tile's
# time, it computed each output element 5-9% faster, so up to
# `_PINGPONG_SHORT_K` it wins unless it leaves the busiest SM more than 5%
# more elements (docs/performance-log.md, "Ping-pong schedule"). At longer K
# (18 GEMMs of training steps, K = 2048-28672, bf16) the busiest SM's elements
# predicted the two tiles' ratio within 3% on 16 of 18, so there it wins
# where it leaves the busiest SM no more elements: the 6 problems where that
# chose it ran 1.007-1.091x faster than with the cooperative tile, 4 of the
# models suite's fit half (fitted) and 2 of its check half (judged; docs/performance-log.md,
# "Large training GEMMs: ping-pong and cluster tiles").
_PINGPONG_CONFIG = TuningConfig(tile_m=128, tile_n=192, tile_k=64, max_concurrent_steps=4,
                                grid_minor_dim=MatmulDimension.M, grid_tile_width=8,
                                schedule=Schedule.PINGPONG)
_PINGPONG_SHORT_K = 2048
# From 4 to 16 K steps the epilogue that ping-pong hides is a larger share
# still: there it wins at up to 12.5% more elements on the busiest SM. On an
# H100 (bf16), where it leaves 1.125x the elements of the cooperative 128x256
# tile, Llama 3's weight gradients (fitted): at K = 256, 2048x256x8192 and
# 8192x256x2048 TN ran 22-23% faster; at K = 512, 2048x512x8192,
# 8192x512x2048 and 4096x512x4096 TN 11-13% faster; at K = 1024,
# 2048x1024x8192, 8192x1024x2048 and 4096x1024x4096 TN 0.6-1.8% faster. At
# K = 2048 ten such products of both halves ran 2-5% slower, and with one or
# two K steps there is no loop to hide an epilogue under: 8192x128x2048 TN
# 7% slower, 4096x80x4096 and 4096x48x4096 NN 3-8% slower. Judged on
# DeepSeek-V2-Lite's kv_b_proj, 2048x512x4096 NN of the models suite's check
# half: 5.3% (bf16) and 4.6% (f16) faster; and 14336x1024x3584 TN (no suite,
# 1.0625x): 8.3% faster (docs/performance-log.md, "Ping-pong at K of 256-1024").
_PINGPONG_SHORTER_K = (256, 1024)
# Up to this K, ping-pong's tiles advance along N (`TuningConfig.grid_minor_dim`)
# where the output is wider than tall, so that each band of `grid_tile_width`
# tiles spans the shorter output dimension. Such a K loop is a few steps and
# the output's stores set the time: on an H100, 8192x256x28672 TN (a weight
# gradient of llama3-70b at 256 tokens, fitted) ran 9% faster along N (213.4
# against 234.0 us; jnp.dot 214.8) and 28672x256x8192 7% slower (221.6 against
# 205.7), every round within 0.5%. Judged on qwen2.5-14b at 512 tokens, of
# the models suite's check half, measured in the same run: 5120x512x13824
# 4.7% faster along N (101.8 against 106.6 us; jnp.dot 102.3), 13824x512x5120
# 5.5% slower (docs/performance-log.md, "Weight gradients at a few hundred
# tokens: the grid's order"). Checked on five more at K <= 512 with N > M
# (wins of 5.3-5.4%, losses of 1.1-1.7%); at K = 1024 order N ran 0.3-1.8%
# faster on nine of ten and 6.4% slower on 4096x1024x11008 TN, at K = 2048
# 18% slower on 8192x2048x28672 TN, so the rule stops at 512
# (docs/performance-log.md, "Ping-pong at K of 256-1024, and the grid's order checked").
_GRID_ALONG_N_MAX_K = 512
# Where the largest tile fills at least one wave, the tiles weighed: 128x256,
# 128x192 and 128x128, each by the output elements its busiest SM computes
# times its cost per multiply-add. The 128x128 tile's cost (1.1, fitted to
# split-K sweeps before this use) predicted its speed against ping-pong's
# 128x192 tile, which leaves the busiest SM as many elements as 128x256
# does, on six 3-5 wave problems of no suite (1024-4096 x 4096-8192 x
# 2560-10240, bf16): model 0.917 of ping-pong's time, measured 0.907-0.922
# (perf/2026-12-04-h200-full-wave-tiles-and-uneven-splits.json).
_FULL_WAVE_TILES = 3
(_HEURISTIC_TILE_K,) = ({tiles.tile_k for tiles, _ in _HEURISTIC_TILES}
                        | {_PINGPONG_CONFIG.tile_k, _TILE_128X64.tile_k,
                           _NARROW_DECODE_TILE[0].tile_k})
_PINGPONG_SHORT_K_MAX_EXTRA_WORK = 1.05
_PINGPONG_SHORTER_K_MAX_EXTRA_WORK = 1.125
_PINGPONG_MAX_EXTRA_WORK = 1.0
# K steps for a K that one step covers (`_with_short_k_step`): the 16-bit
# wgmma's K granule and twice it (32- and 64-byte swizzled rows).
# Where it takes such a step, the cooperative schedule is kept over the
# ping-pong tile (`default_config`), which hides an epilogue under a K loop
# that is here one step: in the ping-pong tile's 64-element steps
# the heuristic's configs ran at 0.82-0.93x jnp.dot on six problems of no
# suite (2048-16384 x 8-32 x 3584-28672, bf16, an H100), and the cooperative
# 128x256 tile in a short step 1.05-1.17x faster than those, and 1.02-1.04x
# faster than ping-pong in a short step on five of the six
# (perf/2026-12-05-h100-short-k-schedules.json).
_SHORT_K_STEPS = (16, 32)
_SHORT_K_EPI_TILE_N = 64


def _num_tiles(problem: operands.MatmulProblem, config: TuningConfig) -> int:
  return -(-problem.m // config.cta_tile_m) * -(-problem.n // config.cta_tile_n)


def _waves_cost(problem: operands.MatmulProblem, config: TuningConfig,
                tile_cost: float = 1.0) -> float:
  """Output elements the busiest SM computes, times `tile_cost`: a proxy for the time."""
  waves = -(-_num_tiles(problem, config) // device_facts().sm_count)
  return waves * config.cta_tile_m * config.cta_tile_n * tile_cost


def _k_splits_options(problem: operands.MatmulProblem, config: TuningConfig,
                      min_k: int | None = None):
  """1, and each split of K into ranges of whole K steps
  (`TuningConfig.split_k_steps`: the last range may end past K) that keeps
  one work item per SM, leaves no range wholly past K, and makes ranges at
  least `min_k` long: by default `_MIN_SPLIT_K` (`_MIN_SPLIT_K_192_TILE` for
  192-wide CTA tiles, `_MIN_SPLIT_K_WIDE_TILE` for wider ones).

  The ranges need not divide K's steps. Where only even divisions were
  offered, a K of a prime count of steps (K = 4544: 71) could not be split,
  and others only into too few ranges to fill the SMs. With uneven ranges,
  on an H200 (bf16): 1x4544x4544 19.1 -> 14.7 us (3 ranges), 16x5120x5120
  17.7 -> 15.3 (3 for 2), 64x3584x4608 10.9 -> 9.5 (3 for 2). Of the 15
  problems whose choice changed (12 of the suites, 3 of the tests), 10 ran
  1-30% faster, 2 level, and 3 slower: 1x3072x3072 by 4% (7.9 against 7.5
  us), 16x11008x4096 by 3.5% (5 ranges for 4), 1x18176x4544 by 1%
  (perf/2026-12-04-h200-full-wave-tiles-and-uneven-splits.json)."""
  k_steps = k_range_steps(problem.k, config.tile_k, 1)
  num_tiles = _num_tiles(problem, config)
  if min_k is None:
    if config.cta_tile_n <= 128:
      min_k = _MIN_SPLIT_K
    elif config.cta_tile_n <= 192:
      min_k = _MIN_SPLIT_K_192_TILE
    else:
      min_k = _MIN_SPLIT_K_WIDE_TILE
  yield 1
  for splits in range(2, k_steps + 1):
    range_steps = k_range_steps(problem.k, config.tile_k, splits)
    if ((splits - 1) * range_steps < k_steps and num_tiles * splits <= device_facts().sm_count
        and range_steps * config.tile_k >= min_k):
      yield splits


def _hbm_bytes_per_us(problem: operands.MatmulProblem, config: TuningConfig) -> float:
  """The HBM rate `_estimated_time_us` gives `config`'s CTA tiles on `problem`:
  `_HBM_BYTES_PER_US`, or its `_DECODE_OTHER_TILES_HBM_SHARE` for tiles other
  than the decode tiles at decode-size M. Only where that share was measured:
  not for outputs at most `_NARROW_MAX_N` wide (their own tiles, never
  weighed against the decode tile) nor for an RHS stored (N, K), whose tiles'
  rows run along K whatever their width."""
  if (problem.m <= _DECODE_SPLIT_MAX_M and problem.n > _NARROW_MAX_N
      and not problem.layout.transpose_rhs
      and (config.cta_tile_m, config.cta_tile_n) not in _DECODE_CTA_TILES):
    return _HBM_BYTES_PER_US * _DECODE_OTHER_TILES_HBM_SHARE
  return _HBM_BYTES_PER_US


def _estimated_time_us(problem: operands.MatmulProblem, config: TuningConfig,
                       tile_cost: float, splits: int) -> float:
  """The model's time for `problem` in `config`'s CTA tiles and `splits` K ranges.

  Compute: the busiest SM's multiply-adds, weighted by the tile's relative
  cost, plus each work item's fixed cost. HBM: the operands once (an output
  this small keeps the reused operand in L2) and the output, or the float32
  partials of a split, at the rate the tile streams them (`_hbm_bytes_per_us`:
  at decode-size M the decode tile streams the weights fastest). A split also
  pays for the XLA sum of its partials.
  """
  m, k, n = problem.m, problem.k, problem.n
  work_items = _num_tiles(problem, config) * splits
  sm_count = device_facts().sm_count
  waves = -(-work_items // sm_count)
  # Every range runs as many K steps as the longest, past K if need be.
  range_k = k_range_steps(k, config.tile_k, splits) * config.tile_k
  compute_us = waves * (config.cta_tile_m * config.cta_tile_n * range_k * tile_cost
                        / _SM_MACS_PER_US + _WORK_ITEM_US)
  partial_bytes = splits * m * n * 4 if splits > 1 else 0
  output_bytes = partial_bytes or m * n * problem.dtype.itemsize
  hbm_us = (((m * k + k * n) * problem.dtype.itemsize + output_bytes)
            / _hbm_bytes_per_us(problem, config))
  if m <= _DECODE_MAX_M and sm_count < work_items < 2 * sm_count:
    # A stream of one to two waves of work items: its second, part-empty wave
    # takes as long as a full one, since its SMs do not stream faster
    # (16x5120x55296 in 216 64x256 tiles, 1.6 waves: 0.84-0.93x jnp.dot; in
    # 108 64x512 tiles: 0.98-1.01x). From two full waves on, the last one's
    # share of the time is small and it ran no slower than a full one would:
    # 8x8192x73728 in 288 64x256 tiles (2.2 waves) ran 1.12x faster than in
    # 144 64x512 ones (1.1 waves), and 16x6144x90112 in 352 (2.7 waves) 1.12x
    # faster than in 176 (1.3 waves).
    hbm_us *= 2 * sm_count / work_items
  kernel_us = (compute_us ** _OVERLAP_NORM + hbm_us ** _OVERLAP_NORM) ** (1 / _OVERLAP_NORM)
  sum_us = _SPLIT_SUM_US + partial_bytes / _SPLIT_SUM_BYTES_PER_US if splits > 1 else 0.0
  return kernel_us + sum_us


def _kernel_operand_swizzle(config: TuningConfig, problem: operands.MatmulProblem,
                            sizes: operands.TmaSizes) -> int:
  """The swizzle (bytes) `ws_matmul` gives both operand tiles of `config` for
  `problem`, whose operands it pads to `sizes` (`kernel_call.ws_tma_sizes`)."""
  return operand_swizzle(config, jax.ShapeDtypeStruct(sizes.lhs, problem.dtype),
                         jax.ShapeDtypeStruct(sizes.rhs, problem.dtype),
                         transpose_lhs=problem.layout.transpose_lhs,
                         transpose_rhs=problem.layout.transpose_rhs)


def _copy_us(padded: tuple[int, int], stored: tuple[int, int], dtype) -> float:
  """The modelled time of the copy between an array's stored shape and the
  one a kernel pads it to (0 where they are the same)."""
  return 0.0 if padded == stored else operands.copy_us(padded, dtype)


def _rhs_padding_us(tiles: TuningConfig, problem: operands.MatmulProblem, out_dtype) -> float:
  """The modelled time of the copy that pads the RHS for `tiles` (0 where
  it is read in place)."""
  return _copy_us(kernel_call.ws_tma_sizes(tiles, problem, out_dtype).rhs,
                  problem.layout.rhs_shape(problem.k, problem.n), problem.dtype)


def _with_one_segment_k_step(config: TuningConfig, problem: operands.MatmulProblem,
                             out_dtype) -> TuningConfig:
  """`config`, or the same with K steps one swizzle segment long where that
  spares the (M, K) LHS its padding copy.

  Where an operand's minor dimension takes only the 64-byte swizzle (a
  (K, N) RHS with N = 4000; `operands.tma_sizes`), 64-element K steps make
  the LHS tiles two segments wide. Mosaic GPU copies those tiled, so a
  ragged M is padded, a copy of the whole LHS. 32-element K steps make them
  one segment wide, copied as boxes in place (`core.tma_copies_in_place`);
  twice the stages keep as many bytes in flight. On an H200 that ran
  4-17% faster on each of the five such shapes measured (100x8192x4000: 26.3
  against 29.0-29.3 us, f16 and bf16; docs/performance-log.md, "A K step of one
  segment under the 64-byte swizzle"). Only this halving
  was measured, so a 32-byte swizzle keeps its steps.
  """
  if problem.layout.transpose_lhs or problem.is_empty:
    # A (K, M) LHS tile's minor dimension is M, not the K step; an empty
    # problem runs no kernel.
    return config
  sizes = kernel_call.ws_tma_sizes(config, problem, out_dtype)
  segment = _kernel_operand_swizzle(config, problem, sizes) // problem.dtype.itemsize
  if sizes.lhs[0] == problem.m or 2 * segment != config.tile_k:
    return config
  try:
    candidate = dataclasses.replace(config, tile_k=segment,
                                    max_concurrent_steps=2 * config.max_concurrent_steps)
  except ValueError:  # Too many slots for the barrier arrays.
    return config
  candidate_sizes = kernel_call.ws_tma_sizes(candidate, problem, out_dtype)
  spares_copy = candidate_sizes.lhs[0] == problem.m and candidate_sizes.rhs == sizes.rhs
  fits = kernel_call.ws_smem_budget(candidate, operands.pad_k(problem, config.tile_k),
                                    out_dtype, has_bias=True).fits()
  return candidate if spares_copy and fits else config


def _with_short_k_step(config: TuningConfig, problem: operands.MatmulProblem,
                       out_dtype) -> TuningConfig:
  """`config`, or the same with one K step as short as K (16 or 32 elements)
  and 64-column epilogue tiles where K is that short.

  A K of at most 32 (a LoRA adapter's up projection, rank 8-32, and the
  product that feeds its d input) is one K step, and the time goes to
  writing the output. A 64-element step loads the operand tiles' columns past
  K as zeros the TMA engine fills in, and a step as long as K spares that.
  On an H200 (bf16, models suite's fit half, the step shortened together
  with 64-column epilogue tiles, as here; which of the two gained how much
  was not measured): 4096x8x4096 11.5 us against 14.7 in 64-element steps
  (jnp.dot 9.7; 32-element steps: 12.9), 4096x16x4096 10.6 against 13.7,
  4096x32x4096 10.6 against 13.2 (16-element steps: 11.3), and with the RHS
  stored (N, K) 4096x8x4096 12.4 against 17.0 (docs/performance-log.md, "Decode
  and LoRA sizes of the models suite's fit half").
  """
  if (problem.is_empty or problem.k > max(_SHORT_K_STEPS) or config.k_splits > 1
      or config.schedule != Schedule.COOPERATIVE):  # Only the cooperative one was measured.
    return config
  tile_k = min(step for step in _SHORT_K_STEPS if step >= problem.k)
  if tile_k >= config.tile_k:
    return config
  candidate = dataclasses.replace(config, tile_k=tile_k,
                                  epi_tile_n=math.gcd(config.epi_tile_n, _SHORT_K_EPI_TILE_N))
  try:
    # A (K, M) LHS with a (K, N) RHS has no tile whose rows run along K, so
    # its swizzle, set by M and N, asks for 64-element K steps.
    kernel_call.check_ws_config(candidate, operands.pad_k(problem, tile_k), out_dtype,
                                has_bias=True)
  except ValueError:
    return config
  return candidate


def _with_unpadded_output(config: TuningConfig, problem: operands.MatmulProblem,
                          out_dtype) -> TuningConfig:
  """`config`, or the same with epilogue tiles one swizzle segment wide where
  those spare a 16-bit output its padding.

  128-column epilogue tiles of a 16-bit output are two segments wide, which
  Mosaic GPU copies tiled: an N whose rows are off 64 bytes (N = 4040) is
  padded to the next 64 columns, and the result is sliced, a copy of the
  whole output. 64-column tiles are one segment, stored as boxes in place
  (`core.tma_copies_in_place`). On an H200 that ran 5-34% faster on each of
  the six such shapes measured (4096x4096x4040: 200.6 against 221.2 us;
  docs/performance-log.md, "64-column epilogue tiles where 128-column ones would pad a
  16-bit output"); only 16-bit outputs were measured.
  """
  itemsize = jnp.dtype(out_dtype).itemsize
  segment = max(SWIZZLE_BYTES) // itemsize
  if (problem.is_empty or config.k_splits > 1 or itemsize != 2
      or config.epi_tile_n <= segment or config.tile_n % segment):
    return config
  if kernel_call.ws_tma_sizes(config, problem, out_dtype).out == (problem.m, problem.n):
    return config
  candidate = dataclasses.replace(config, epi_tile_n=segment)
  unpadded = kernel_call.ws_tma_sizes(candidate, problem, out_dtype).out == (problem.m, problem.n)
  fits = kernel_call.ws_smem_budget(candidate, operands.pad_k(problem, config.tile_k),
                                    out_dtype, has_bias=True).fits()
  return candidate if unpadded and fits else config


def _with_rhs_copy_us(config: TuningConfig, time_us: float, problem: operands.MatmulProblem,
                      out_dtype) -> float:
  """`time_us`, the modelled time of `config`, with its RHS copy added, or
  times `_ONE_SEGMENT_RHS_TILES_COST` where `_with_rhs_in_place` reads that
  RHS in place instead."""
  # Two stages: the fewest `default_config` gives any tile, so the SMEM check fits.
  config = dataclasses.replace(config, max_concurrent_steps=2)
  in_place = _with_rhs_in_place(config, problem, out_dtype)
  if in_place != config:
    return time_us * _ONE_SEGMENT_RHS_TILES_COST[config.tile_n // in_place.rhs_tile_n]
  return time_us + _rhs_padding_us(config, problem, out_dtype)


def deepest_fitting[C: (TuningConfig, Fp8Config)](config: C, stages, fits) -> C | None:
  """`config` (a bf16/f16 or a block-scaled FP8 kernel's) with the first of
  `stages` (pipeline depths, deepest first) for which `fits(config)` holds,
  or None if none does. Deeper pipelines hide more load latency, so every
  default takes the deepest that its SMEM holds."""
  for steps in stages:
    candidate = dataclasses.replace(config, max_concurrent_steps=steps)
    if fits(candidate):
      return candidate
  return None


def clusters_take_no_more_waves(config: TuningConfig, problem: operands.MatmulProblem) -> bool:
  """Whether pairs of vertically adjacent CTA tiles, run as 2-CTA clusters
  (`TuningConfig.cluster_m` = 2), take no more waves on the SMs than single
  CTAs: an odd count of M tiles leaves one block of the last pair computing
  for nothing, and a cluster needs two SMs free at once."""
  m_tiles = -(-problem.m // config.cta_tile_m)
  per_m_tile = -(-problem.n // config.cta_tile_n) * config.k_splits
  sm_count = device_facts().sm_count
  waves = -(-m_tiles * per_m_tile // sm_count)
  pairs = -(-m_tiles // 2)
  cluster_waves = -(-pairs * per_m_tile // (sm_count // 2))
  return cluster_waves <= waves


def _with_rhs_in_place(config: TuningConfig, problem: operands.MatmulProblem,
                       out_dtype) -> TuningConfig:
  """`config`, or the same with one-segment RHS tiles multicast to clusters of
  two CTAs where that reads a (K, N) RHS in place at the widest swizzle.

  RHS tiles several segments wide are copied tiled, so a (K, N) RHS whose N
  is off 64 columns is padded (N = 3000: a copy of the whole RHS) or, with N
  on 32 columns, read under a narrower swizzle. One-segment RHS tiles
  (`TuningConfig.rhs_tile_n`) are boxes, read in place at any N on 16
  bytes. Their rows then start off 128 bytes, so each spans one more
  128-byte line, which every row of CTA tiles reads again from L2; two CTAs
  along M that share each RHS tile by multicast (`TuningConfig.cluster_m`)
  halve those reads. On an H200 at 1000x4096x3000 (f16): 51.0 us padded,
  41.0 in place, 35.7 in place with clusters (`jnp.dot`: 35.6). Each extra
  RHS tile costs the main loop a wgmma of its own
  (`_ONE_SEGMENT_RHS_TILES_COST`), so the change is made where the model
  has it spare more than that: the RHS copy (`operands.copy_us`) or the
  narrower swizzle's slowdown. Only for M over `_IN_PLACE_RHS_MAX_M`:
  smaller M has tiles of its own that read such an RHS in place. Clusters
  are used unless the pairs of M tiles (an odd count leaves one block of
  the last pair computing for nothing) would take another wave.
  """
  segment = max(SWIZZLE_BYTES) // problem.dtype.itemsize
  if (problem.is_empty or problem.layout.transpose_rhs or problem.m <= _IN_PLACE_RHS_MAX_M
      or config.schedule != Schedule.COOPERATIVE or config.rhs_tile_width <= segment
      or config.tile_n % segment):
    return config
  stored = problem.layout.rhs_shape(problem.k, problem.n)
  sizes = kernel_call.ws_tma_sizes(config, problem, out_dtype)
  swizzle = _kernel_operand_swizzle(config, problem, sizes)
  current_us = operands.main_loop_us(problem, out_dtype, swizzle)
  if sizes.rhs != stored:
    current_us += operands.copy_us(sizes.rhs, problem.dtype)
  in_place_us = (operands.main_loop_us(problem, out_dtype, max(SWIZZLE_BYTES))
                 * _ONE_SEGMENT_RHS_TILES_COST[config.tile_n // segment])
  if in_place_us >= current_us:
    return config
  candidate = dataclasses.replace(config, rhs_tile_n=segment,
                                  epi_tile_n=math.gcd(config.epi_tile_n, segment),
                                  cluster_m=2 if clusters_take_no_more_waves(config, problem)
                                  else 1)
  candidate_sizes = kernel_call.ws_tma_sizes(candidate, problem, out_dtype)
  in_place = (candidate_sizes.rhs == stored and candidate_sizes.lhs == sizes.lhs
              and _kernel_operand_swizzle(candidate, problem, candidate_sizes)
              == max(SWIZZLE_BYTES))
  fits = kernel_call.ws_smem_budget(candidate, operands.pad_k(problem, config.tile_k),
                                    out_dtype, has_bias=True).fits()
  return candidate if in_place and fits else config


def default_config(problem: operands.MatmulProblem, out_dtype, *,
                   cooperative_only: bool = False, grouped: bool = False) -> TuningConfig:
  """A sound config without tuning.

  The sweeps on an H200 (docs/performance-log.md, "Sweeps") favour a 128x256 CTA tile made of two
  64x256 warpgroup tiles (the widest wgmma) split along M, 3-4 stages and
  64x128 epilogue tiles. A cooperative 128x192 or 128x128 tile replaces it
  where its last wave leaves enough fewer SMs idle for its cost per
  multiply-add (`_TILE_192_COST`, `_FULL_WAVE_TILES`; 4999x4096x2500:
  128x192, 5.6% faster; 2048x4096x5120: 128x128, 9% faster than ping-pong).
  The ping-pong schedule's 128x192 tile replaces the cooperative choice
  where it leaves the busiest SM no more output, or at most 5% more where
  K <= 2048 and the epilogue it hides is a larger share of the time
  (16384x1024x8192: 6.5% faster than 128x256; 8192x4096x28672, (K, M) LHS:
  9% faster), and at most 12.5% more where K is 256-1024 (`_PINGPONG_SHORTER_K`;
  2048x512x4096: 5% faster on an H100). At K <= 512 with N > M its tiles advance along N
  (`_GRID_ALONG_N_MAX_K`; 8192x256x28672 TN on an H100: 9% faster).

  Problems with too few 128x256 tiles to fill the SMs get the CTA tile and
  split of K (`TuningConfig.k_splits`) with the least modelled time
  (`_estimated_time_us`): at M = 512, N = 4096 that is 128x128 tiles (1.65x
  faster than 128x256); at 512x16384x1024, 128x256 tiles with K in 8 ranges
  (0.88 of cuBLAS, where the unsplit 64x128 tile ran at 0.41); at
  128x8192x8192, which streams 128 MB of RHS from HBM, 128x128 tiles in 2
  ranges, since each split adds float32 partials to that traffic (1.13x
  faster than 128x256 tiles in 4). The ranges need not divide K's steps
  (1x4544x4544, 71 steps: in 3 ranges, 1.3x faster than unsplit). CTA
  tiles up to 128 wide may split K into ranges as short as 512
  (128x32768x128: 64 ranges, 1.32x cuBLAS), 192-wide ones into ranges of
  1024 (333x4096x2048: 4 ranges, 7% faster than unsplit 64x128 tiles),
  wider ones into ranges of 2048 or more. Decode-size M (64 rows or fewer)
  goes through this model even where 128x256 tiles would fill
  a wave, and may also take a 64x256 tile, in K ranges up to 16 rows
  (16x8192x8192: in 4 ranges, 1.03x cuBLAS), unsplit up to 64
  (16x8192x57344: 0.92x cuBLAS, where 128x256 tiles ran at 0.70x). Up to 16
  rows the model has the other tiles stream the weights at 0.8 of that tile's rate
  (`_DECODE_OTHER_TILES_HBM_SHARE`; 16x8192x10240: 64x256 tiles in 2 ranges
  ran 1.18x faster than the unsplit 64x128 ones it had level). A stream of
  one to two waves of work items costs two whole waves, and an unsplit 64x512 tile
  streams twice the columns of a 64x256 one (`_WIDE_DECODE_TILE`;
  16x5120x55296: 108 of them in one wave ran 1.09x (bf16) and 1.12x (f16)
  faster than 216 64x256 tiles in 1.6 waves, level with cuBLAS). Where
  larger tiles would pad a (K, N) RHS whose N is off 64 columns and M is at
  most 256, tiles with one-segment RHS tiles read it in
  place, the others paying for the copy: 64x128 tiles where M <= 64
  (1x8192x3000: 2.0x faster than 128x64 tiles), 128x64 ones above
  (`_IN_PLACE_RHS_TILE`; 128x8192x3000: 2.1x faster than padded 128x192
  tiles). Beyond M = 256, wider tiles load such an RHS in 64-column tiles
  multicast to 2-CTA clusters, where the model has that cheaper than the pad
  or a narrower swizzle (`_with_rhs_in_place`; 1000x4096x3000: 1.42x faster
  than padded, level with cuBLAS); where such an output has too few tiles for
  a wave, the model weighs each tile's pad against that (700x8192x3000:
  128x192 tiles in clusters, 1.76x faster than padded 64x128 ones).

  Outputs at most 64 columns wide (N <= 64: low-rank projections, routers)
  take 64-column CTA tiles, 128x64 or, where M <= 64, 64x64, in the split
  of K the model has fastest, with ranges as short as 256 and 8 stages
  (`_NARROW_TILE`; 4096x4096x64: 1.33x cuBLAS in 4 ranges, where 128x128
  tiles ran at 0.96x). Outputs at most 16 columns wide with the RHS stored
  (N, K) take 128x16 tiles in the same split instead
  (`_NARROW_TRANSPOSED_RHS_TILE`; 4096x4096x16 NT on an H100: 1.39x cuBLAS,
  where 128x64 tiles ran at 0.99x).

  Unsplit 128x128 and 64x128 CTA tiles get 6 operand stages, which hide HBM
  latency where the problem streams a large operand (256x8192x8192 and
  8192x8192x256: 5-11% faster than 4 stages); larger tiles and float32
  partial tiles leave room for fewer. Fewer stages are used where SMEM is
  short. A 128x128 tile whose SMs each run several tiles with K loops under
  256 steps gets 5 (`_tile_changes_cost_a_sixth_stage`; 2048x5120x5120 on
  an H100: 1.11x faster than 6). A 64x128 tile in one wave with K loops of
  at most 64 steps gets 4 (`_one_wave_tile_takes_four_stages`; 256x2304x4096
  on an H100: 1.07x faster than 6).

  A K of 32 or less (LoRA ranks) takes one K step as long as K, 16 or 32
  elements, with 64-column epilogue tiles (`_with_short_k_step`; 4096x8x4096:
  1.27x faster than in a 64-element step), on the cooperative schedule even
  where the ping-pong tile would take the problem (2048x8x11008: 1.17x faster
  on an H100).

  A 16-bit output that 128-column epilogue tiles would pad (N = 4040) gets
  64-column ones, stored in place (`_with_unpadded_output`; 5-34% faster on
  six such shapes). Where an operand allows only the 64-byte swizzle and the
  LHS's M would be padded, the K step is 32 elements, so that the LHS is
  read in place (`_with_one_segment_k_step`; 100x8192x4000: 10-12% faster).

  Decode-size products (at most 16 rows of an LHS of either layout) whose
  output is 65-8192 columns wide and whose weight rows are whole 128-byte
  segments run as their transpose, out.T = op(rhs).T @ op(lhs).T
  (`TuningConfig.swap_operands`, `_TRANSPOSED_DECODE_MAX_N`), in this
  heuristic's config for that product: the activations' rows are then an RHS
  tile's, which no TMA load reads past (16x4096x4096: 1.39x faster in bf16,
  1.45x in f16, on an H100).

  Args:
    problem: the (M, K, N) problem and operand dtype.
    out_dtype: the output dtype (the SMEM of the epilogue tiles).
    cooperative_only: never the ping-pong schedule nor the transposed
      product, for kernels that run only the cooperative one on the problem
      as given (the quantized output).
    grouped: the config of a grouped matmul (`ragged_dot`) for its dense
      problem of all rows: cooperative only, and without the one-wave depth
      rule (`_one_wave_tile_takes_four_stages`), since a grouped grid has a
      work item per table entry (or group) and output tile, more than the
      dense problem's tiles.
  """
  cooperative_only = cooperative_only or grouped
  if not cooperative_only and _runs_transposed(problem):
    return dataclasses.replace(default_config(problem.transposed_product(), jnp.float32),
                               swap_operands=True)
  if not cooperative_only and _transposes_rhs_first(problem):
    return dataclasses.replace(default_config(problem.with_rhs_transposed(), out_dtype),
                               transpose_rhs_first=True)
  config = _finished_config(problem, out_dtype, cooperative_only=cooperative_only,
                            grouped=grouped)
  if config.schedule == Schedule.PINGPONG:
    cooperative = _finished_config(problem, out_dtype, cooperative_only=True, grouped=False)
    if problem.k <= max(_SHORT_K_STEPS) and cooperative.tile_k < config.tile_k:
      return cooperative  # One short K step (`_SHORT_K_STEPS`).
    # Ping-pong's tiles have no one-segment RHS tiles nor clusters, so where
    # they would pad an operand that the cooperative choice reads in place
    # (a ragged N, `_with_rhs_in_place`), that copy costs more than the
    # epilogue they hide (2048x4096x3000, bf16: the RHS, 23 MB).
    if _padding_us(cooperative, problem, out_dtype) < _padding_us(config, problem, out_dtype):
      return cooperative
  return config


def _runs_transposed(problem: operands.MatmulProblem) -> bool:
  """Whether `default_config` has `problem` run as its transpose: decode-size
  M (an LHS of either layout), an output 65-8192 columns wide, and weights whose rows
  are whole 128-byte swizzle segments. As the transposed product's LHS,
  weights with rows off them would be padded, or read with a narrower
  swizzle, where today's decode tiles read them in place (1x8192x3000)."""
  weight_row = problem.k if problem.layout.transpose_rhs else problem.n
  return (problem.m <= _NARROW_TRANSPOSED_RHS_MAX_N
          and _NARROW_MAX_N < problem.n <= _TRANSPOSED_DECODE_MAX_N
          and weight_row * problem.dtype.itemsize % max(SWIZZLE_BYTES) == 0)


def _transposes_rhs_first(problem: operands.MatmulProblem) -> bool:
  """Whether `default_config` has XLA transpose a (K, N) RHS first: an output
  at most `_NARROW_TRANSPOSED_RHS_MAX_N` wide over more than
  `_TRANSPOSE_RHS_FIRST_MIN_M` rows (more than the narrow decode tile holds,
  so an (N, K) RHS takes 16-column tiles)."""
  return (problem.n <= _NARROW_TRANSPOSED_RHS_MAX_N and not problem.layout.transpose_rhs
          and problem.m > _TRANSPOSE_RHS_FIRST_MIN_M)


def quantized_output_config(problem: operands.MatmulProblem) -> TuningConfig:
  """A config for an output quantized to e4m3 in the epilogue
  (`kernel_call.ws_matmul` with out_dtype float8_e4m3fn): `default_config`'s
  cooperative choice for a 16-bit output, made one that can quantize. Its
  warpgroups split M (so each one's columns start on a quantization block)
  in tiles of 128 or, where that choice is wider than 128 columns, 256
  columns; epilogue tiles of 128 columns (one block each); no split of K
  nor cluster; the choice's K step where these wider tiles can swizzle it
  (a short K step of a (K, M) LHS cannot: its 128-column tiles take a
  128-byte swizzle, which needs 64-element K steps), else 64; then the
  deepest pipeline up to 6 stages that fits. It reuses the measured choice
  of tile height and width, not a fitted one.
  """
  base = default_config(problem, jnp.bfloat16, cooperative_only=True)
  tiles = TuningConfig(tile_m=64, tile_n=256 if base.cta_tile_n > 128 else 128,
                       tile_k=base.tile_k, wg_dimension=MatmulDimension.M,
                       epi_tile_n=FP8_SCALE_BLOCK, grid_minor_dim=base.grid_minor_dim,
                       grid_tile_width=base.grid_tile_width)
  try:
    check_swizzle(tiles, problem.dtype, transpose_lhs=problem.layout.transpose_lhs,
                  transpose_rhs=problem.layout.transpose_rhs)
  except ValueError:
    tiles = dataclasses.replace(tiles, tile_k=TuningConfig().tile_k)
  padded = operands.pad_k(problem, tiles.tile_k)
  config = deepest_fitting(
      tiles, range(6, 1, -1),
      lambda c: kernel_call.ws_smem_budget(c, padded, FP8_DTYPE, has_bias=True).fits())
  assert config is not None, "two stages of 128x256 tiles always fit"
  return config


def _finished_config(problem: operands.MatmulProblem, out_dtype, *,
                     cooperative_only: bool, grouped: bool) -> TuningConfig:
  """`default_config` before ping-pong is weighed against the cooperative choice's copies."""
  config = _with_rhs_in_place(_tiled_config(problem, out_dtype, cooperative_only=cooperative_only,
                                            grouped=grouped),
                              problem, out_dtype)
  config = _with_unpadded_output(config, problem, out_dtype)
  config = _with_short_k_step(config, problem, out_dtype)
  return _with_one_segment_k_step(config, problem, out_dtype)


def _padding_us(config: TuningConfig, problem: operands.MatmulProblem, out_dtype) -> float:
  """The modelled time of the copies that `config`'s kernel needs around it:
  each operand padded and the output sliced where TMA cannot read or write
  them in place (0 where it can)."""
  sizes = kernel_call.ws_tma_sizes(config, problem, out_dtype)
  return (_copy_us(sizes.lhs, problem.layout.lhs_shape(problem.m, problem.k), problem.dtype)
          + _copy_us(sizes.rhs, problem.layout.rhs_shape(problem.k, problem.n), problem.dtype)
          + _copy_us(sizes.out, (problem.m, problem.n), out_dtype))


def _narrow_config(problem: operands.MatmulProblem, out_dtype) -> TuningConfig:
  """`default_config` for an output at most `_NARROW_MAX_N` columns wide
  (`problem` with K rounded up to whole K steps): 64-column CTA tiles (16-column
  ones at N <= 16 over an (N, K) RHS), the split of K the model has fastest
  for the 64-column tile, the deepest pipeline that fits."""
  tiles, tile_cost = (_NARROW_DECODE_TILE if problem.m <= _NARROW_DECODE_TILE[0].cta_tile_m
                      else _NARROW_TILE)
  # min() keeps the fewest splits of equal times.
  splits = min(_k_splits_options(problem, tiles, min_k=_MIN_SPLIT_K_NARROW),
               key=lambda splits: _estimated_time_us(problem, tiles, tile_cost, splits))
  if (problem.n <= _NARROW_TRANSPOSED_RHS_MAX_N and problem.layout.transpose_rhs
      and tiles == _NARROW_TILE[0]):
    tiles = _NARROW_TRANSPOSED_RHS_TILE
  config = deepest_fitting(
      dataclasses.replace(tiles, k_splits=splits), _NARROW_STAGES,
      lambda c: kernel_call.ws_smem_budget(c, problem, out_dtype, has_bias=True).fits())
  assert config is not None, "two stages of 64-column tiles always fit"
  return config


# The sixth operand stage of a 128x128 CTA tile pays only within one tile's
# K loop: where each SM runs several tiles, and their K loops are shorter
# than this many steps, 5 stages ran faster. On an H100 (bf16), fitted on 14
# problems: 2048x{2048,4096,8192}x5120 (4.8 waves; 32-128 steps) 1.03-1.10x
# faster on 5 stages, 2048x16384x5120 (256 steps) level, one-wave grids level
# or slower (256x8192x8192 and 8192x8192x256, the problems that set 6 stages:
# 2% and 4% slower). Checked on 5 problems that no fit used (1.05-1.09x, and
# level at 192 steps) and on the models suite's check half (2048x5120x5120:
# 1.11x); docs/performance-log.md, "A sixth operand stage costs".
_SIX_STAGES_MIN_STEPS_SEVERAL_TILES = 256


def _tile_changes_cost_a_sixth_stage(problem: operands.MatmulProblem,
                                     tiles: TuningConfig) -> bool:
  """Whether a 128x128 CTA tile's SMs each run several tiles with K loops
  too short for a sixth stage to repay its cost at every change of tile."""
  return ((tiles.cta_tile_m, tiles.cta_tile_n) == (128, 128)
          and _num_tiles(problem, tiles) > device_facts().sm_count
          and problem.k // tiles.tile_k < _SIX_STAGES_MIN_STEPS_SEVERAL_TILES)


# A 64x128 CTA tile in a grid of one wave ran faster on 4 operand stages than
# on 5 or 6, up to this many K steps (the fit's longest loop; 128x128 tiles in
# one wave lost 6-8% on 4 stages at 128 steps). On an H100 (bf16), fitted on 8
# problems: the 7 in one wave (M 1-320, 22-64 steps) 1.02-1.08x faster; at
# 448x6144x4352 (238 tiles) 4 stages ran 12% slower, so several waves keep 6.
# Checked on 11 problems that no fit used: 1.01-1.08x on 10 (the models
# suite's check half's four also in f16: 1.07-1.08x), 0.965x at 96x2560x6144;
# docs/performance-log.md, "Four operand stages for 64x128 tiles".
_FOUR_STAGES_MAX_STEPS_ONE_WAVE = 64


def _one_wave_tile_takes_four_stages(problem: operands.MatmulProblem,
                                     tiles: TuningConfig) -> bool:
  """Whether a 64x128 CTA tile's grid is one wave at most, with K loops short
  enough that stages past 4 cost more than they hide."""
  return ((tiles.cta_tile_m, tiles.cta_tile_n) == (64, 128)
          and _num_tiles(problem, tiles) <= device_facts().sm_count
          and problem.k // tiles.tile_k <= _FOUR_STAGES_MAX_STEPS_ONE_WAVE)


def _tiled_config(problem: operands.MatmulProblem, out_dtype, *,
                  cooperative_only: bool, grouped: bool) -> TuningConfig:
  """`default_config`'s tiles, split, stages and epilogue tiles, before the
  changes that spare a padding copy (`_with_unpadded_output`,
  `_with_one_segment_k_step`)."""
  # Every heuristic tile steps through K in 64s; a last partial step costs a
  # whole one, so the model sees K rounded up.
  problem = operands.pad_k(problem, _HEURISTIC_TILE_K)
  if problem.n <= _NARROW_MAX_N:
    return _narrow_config(problem, out_dtype)
  (largest, _), *_ = _HEURISTIC_TILES
  if (_num_tiles(problem, largest) >= device_facts().sm_count
      and problem.m > _SMALL_TILE.cta_tile_m):
    # At least one full wave of the largest tile: its efficiency wins, unless
    # the 128x192 or 128x128 tile's last wave leaves enough fewer SMs idle
    # for its cost per multiply-add (`_FULL_WAVE_TILES`). Not at M of
    # one 64-row tile or less, where 128-row tiles compute half their rows or
    # more past M and the weights' stream sets the time: there the model below
    # weighs 64-row tiles too (16x8192x57344 and 16x8192x128256, bf16:
    # 128x256 tiles ran at 0.68x and 0.73x jnp.dot, the decode tile at 0.95x
    # and 0.98x; docs/performance-log.md, "Decode and LoRA sizes of the models
    # suite's fit half").
    # min() keeps the first (largest) of equal costs.
    tiles, tiles_cost = min(((t, _waves_cost(problem, t, cost))
                             for t, cost in _HEURISTIC_TILES[:_FULL_WAVE_TILES]),
                            key=lambda option: option[1])
    splits = 1
    pingpong = _PINGPONG_CONFIG
    if problem.k <= _GRID_ALONG_N_MAX_K and problem.n > problem.m:
      pingpong = dataclasses.replace(pingpong, grid_minor_dim=MatmulDimension.N)
    if _PINGPONG_SHORTER_K[0] <= problem.k <= _PINGPONG_SHORTER_K[1]:
      max_extra_work = _PINGPONG_SHORTER_K_MAX_EXTRA_WORK
    elif problem.k <= _PINGPONG_SHORT_K:
      max_extra_work = _PINGPONG_SHORT_K_MAX_EXTRA_WORK
    else:
      max_extra_work = _PINGPONG_MAX_EXTRA_WORK
    if (not cooperative_only
        and _waves_cost(problem, pingpong) <= max_extra_work * tiles_cost
        and kernel_call.ws_smem_budget(pingpong, problem, out_dtype,
                                     has_bias=True).fits()):
      return pingpong
  else:
    candidates = _HEURISTIC_TILES + ((_DECODE_TILE, _WIDE_DECODE_TILE)
                                     if problem.m <= _DECODE_MAX_M else ())
    # Only where some tiles pad an RHS whose rows are off 128 bytes and the
    # small ones read it in place do the candidates pay for their pads:
    # elsewhere they pad alike, or not at all (an N below a CTA tile is
    # padded to it, which was not measured against these tiles).
    ragged_rows = problem.n * problem.dtype.itemsize % max(SWIZZLE_BYTES) != 0
    padding_us = {}  # Each tile's RHS copy, worked out once.
    if (not problem.is_empty and problem.m <= _IN_PLACE_RHS_MAX_M
        and not problem.layout.transpose_rhs and ragged_rows):
      padding_us = {tiles: _rhs_padding_us(tiles, problem, out_dtype)
                    for tiles, _ in (*candidates, _IN_PLACE_RHS_TILE)}
    weigh_pads = (bool(padding_us) and padding_us[_SMALL_TILE] == 0
                  and any(padding_us[tiles] > 0 for tiles, _ in candidates))
    if weigh_pads:
      # min() below keeps the first of equal times.
      candidates = ((_IN_PLACE_RHS_TILE, *candidates) if problem.m > _SMALL_TILE.cta_tile_m
                    else (*candidates, _IN_PLACE_RHS_TILE))
    # Beyond M = 256, each option pays for its pad of an RHS whose rows are
    # off 128 bytes or, where `_with_rhs_in_place` would read that RHS in
    # place in one-segment tiles, for their extra wgmmas (12 problems on an
    # H200, each 1.02-1.78x faster than without this; docs/performance-log.md, "Beyond
    # M = 256: the small-output model weighs the pads").
    weigh_in_place = (not problem.is_empty and problem.m > _IN_PLACE_RHS_MAX_M
                      and not problem.layout.transpose_rhs and ragged_rows)
    options = []
    for i, (tiles, tile_cost) in enumerate(candidates):
      for splits in _k_splits_options(problem, tiles):
        if tiles is _DECODE_TILE[0] and splits > 1 and problem.m > _DECODE_SPLIT_MAX_M:
          continue
        if tiles is _WIDE_DECODE_TILE[0] and splits > 1:
          continue
        time_us = _estimated_time_us(problem, tiles, tile_cost, splits)
        if weigh_pads:
          time_us += padding_us[tiles]
        elif weigh_in_place:
          time_us = _with_rhs_copy_us(dataclasses.replace(tiles, k_splits=splits), time_us,
                                      problem, out_dtype)
        options.append((time_us, i, tiles, splits))
    # min() keeps the first (largest tile, fewest splits) of equal costs.
    *_, tiles, splits = min(options, key=lambda option: option[:2])
  if problem.n <= 128:
    tiles = dataclasses.replace(tiles, tile_n=min(tiles.tile_n, 128))
  # Stages hide load latency, so give up epilogue width before stages. With
  # float32 partials, 5 stages ran 3% slower than 4 (128x128 tiles at
  # 128x8192x8192 and 128x16384x4096), so splits start at 4. Stages beyond
  # a short K loop's steps hide nothing, and its time goes to the epilogue:
  # at 4096x80x4096, 6 stages with 64-wide epilogue tiles ran 6% slower than
  # 4 with 128-wide ones.
  deep = ((6, 64), (5, 64)) if splits == 1 and problem.k // tiles.tile_k > 6 else ()
  if deep and _tile_changes_cost_a_sixth_stage(problem, tiles):
    deep = deep[1:]
  if not grouped and _one_wave_tile_takes_four_stages(problem, tiles):
    deep = ()
  for steps, epi_tile_n in (*deep, (4, 128), (3, 128), (4, 64), (3, 64), (2, 64)):
    config = dataclasses.replace(tiles, max_concurrent_steps=steps,
                                 epi_tile_n=math.gcd(epi_tile_n, tiles.tile_n), k_splits=splits)
    if kernel_call.ws_smem_budget(config, problem, out_dtype, has_bias=True).fits():
      return config
  raise AssertionError("unreachable: two stages of 128x256 tiles always fit")
