"""Configs of the matmul kernels: frozen, keyword-only, hashable, validated when built.

Each config checks what it can know alone (positive tiles, multiples the
hardware needs); the wrappers check it against the problem and the SMEM budget
(`kernel_call.check_ws_config`, `PipelinedConfig.smem_budget`) before anything
is compiled.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar

import jax.numpy as jnp

from core import PipelineOptions, SmemBudget, SmemBuffer, swizzle_bytes, tma_swizzle
from core.compiler import MAX_BARRIERS_PER_ARRAY
from core.device import (
    WARPGROUP_THREADS,
    WGMMA_K_16BIT,
    WGMMA_M,
    WGMMA_MAX_N,
    WGMMA_N_MULTIPLE,
)

# CTAs per cluster along M (`TuningConfig.cluster_m`).
CLUSTER_SIZES = (1, 2)
# K must be whole wgmma K steps.
K_MULTIPLE = WGMMA_K_16BIT
OPERAND_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
# The compute warpgroups of the warp-specialized kernel (plus one memory warpgroup).
NUM_COMPUTE_WGS = 2
# Registers per thread a warpgroup's float32 accumulator may take (a compute
# warpgroup of the warp-specialized kernel gets 232, the pipelined kernel's
# one warpgroup at most 255): 64x256 (128) and 128x192 (192) tiles run at full
# speed on an H200; 128x256 (256) spills and runs at a fifth of that.
MAX_ACCUMULATOR_REGISTERS = 192


class MatmulDimension(enum.IntEnum):
  """An output dimension: which one the grid walks fastest, or the compute
  warpgroups split."""

  M = 0
  N = 1

  def __repr__(self) -> str:
    return f"MatmulDimension.{self.name}"


class Schedule(enum.Enum):
  """How the two compute warpgroups of the warp-specialized kernel share the work.

  COOPERATIVE: both work on one CTA tile, each on its half along
    `wg_dimension`; they run their K loops and then their epilogues together,
    so the tensor cores idle during the epilogue.
  PINGPONG: each works on its own output tile, alternately, so one's
    epilogue can run while the other runs its K loop (the loads pace them;
    see `pingpong_matmul_sm90`). A CTA tile is one warpgroup tile; one ring
    of SMEM slots runs through the K steps of all of a block's tiles.
  """

  COOPERATIVE = "cooperative"
  PINGPONG = "pingpong"

  def __repr__(self) -> str:
    return f"Schedule.{self.name}"


def k_range_steps(k: int, tile_k: int, k_splits: int) -> int:
  """K steps in each of `k_splits` ranges of a K of `k` in steps of `tile_k`:
  the K steps (the last may be partial) shared out, rounded up. The last
  range may then end past K, where TMA reads zeros, so no K is padded for a
  split: K = 4544 (71 steps of 64) splits into 4 ranges of 18 steps."""
  k_steps = -(-k // tile_k)
  return -(-k_steps // k_splits)


def _check_positive_multiple(name: str, value: int, multiple: int) -> None:
  if not isinstance(value, int) or value <= 0 or value % multiple:
    raise ValueError(f"{name}={value!r} must be a positive multiple of {multiple}")


def _check_tiles(tile_m: int, tile_n: int, tile_k: int) -> None:
  """Raises unless one warpgroup can hold a (tile_m, tile_n) wgmma accumulator."""
  _check_positive_multiple("tile_m", tile_m, WGMMA_M)
  _check_positive_multiple("tile_n", tile_n, WGMMA_N_MULTIPLE)
  _check_positive_multiple("tile_k", tile_k, K_MULTIPLE)
  if tile_n > WGMMA_MAX_N:
    raise ValueError(f"tile_n={tile_n} exceeds the wgmma maximum of {WGMMA_MAX_N}")
  registers = tile_m * tile_n // WARPGROUP_THREADS
  if registers > MAX_ACCUMULATOR_REGISTERS:
    raise ValueError(
        f"a ({tile_m}, {tile_n}) float32 accumulator needs {registers} registers per thread "
        f"of its warpgroup, more than {MAX_ACCUMULATOR_REGISTERS}; use tile_m * tile_n <= "
        f"{MAX_ACCUMULATOR_REGISTERS * WARPGROUP_THREADS} (e.g. 64x256 or 128x192)")


# FP8 operands (`fp8_matmul`): e4m3 values, one float32 scale per block of
# `FP8_SCALE_BLOCK` along K (and along N for the RHS). wgmma reads 8-bit
# operands K-major only, 32 of K per instruction.
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_SCALE_BLOCK = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Config:
  """The block-scaled FP8 matmul (`fp8_matmul`).

  Each compute warpgroup owns (`TILE_M`, `TILE_N`) of the output and steps
  through K in `TILE_K`: a K step is one scale block, so each step's wgmma
  product is scaled once and added to a float32 running sum in registers,
  and the width is one block of the RHS's scales, so each step has one RHS
  scale. The warpgroup holds the step's accumulator and the running sum, 64
  registers a thread each.

  Attributes:
    max_concurrent_steps: SMEM slots per operand (clamped to the K steps).
    compute_wgs: compute warpgroups per CTA tile: 2 (the default), a
      (128, 128) tile with a memory warpgroup that loads each step once for
      both (`emit_fp8_matmul_warp_specialized`); 3, a (192, 128) tile on the
      persistent kernel only, each compute warpgroup with 160 registers a
      thread (the memory warpgroup keeps 24); or 1, a (64, 128) tile whose
      warpgroup also issues the loads (`emit_fp8_matmul`). On an H200 two
      ran 1.19-1.65x faster than one, on 5 problems of 4096-8192 rows
      (docs/performance-log.md, "FP8 on the H200"); on an H100 three ran
      1.10-1.12x faster than two where both tiles divide M ("A third compute
      warpgroup for the block-scaled FP8 kernel"). `fp8.default_config`
      chooses between two and three for a problem.
    persistent: with 2 or 3 compute warpgroups, one block per SM walks the
      output tiles (`emit_fp8_matmul_persistent`: a tile's epilogue overlaps
      the next tile's loads, and the tiles go in `matmul`'s swizzled order)
      instead of one block per tile. None (the default) means True with a
      memory warpgroup and False with 1 compute warpgroup (`runs_persistent`),
      so that `dataclasses.replace(config, compute_wgs=1)` keeps a valid default.
      On an H200 it ran 1.22x, 1.08x and 1.01x the one-block-per-tile grid at
      8192x4096x14336, 8192^3 and 4096^3 and 0.985x at 8192x14336x4096
      (docs/performance-log.md, "The block-scaled FP8 kernel on a persistent
      grid").
    k_blocks_per_step: scale blocks a pipeline step of the persistent kernel
      loads and multiplies: 1, or 2, where each compute warpgroup issues both
      blocks' wgmmas into two accumulators and adds the first block's scaled
      product while the second's runs (`_add_two_scaled_block_products`). A
      K of an odd number of blocks takes steps of one. With 2, each slot
      holds two blocks, so `max_concurrent_steps` = 2 takes the SMEM of 4
      one-block slots. On an H100 at 8192x4096x14336 it ran 1.006x the
      default, within the noise (docs/performance-log.md, "The FP8
      quantization kernels, two-block steps and the N <= 16 tile rule on a
      GPU").
  """

  TILE_M: ClassVar[int] = WGMMA_M
  TILE_N: ClassVar[int] = FP8_SCALE_BLOCK
  TILE_K: ClassVar[int] = FP8_SCALE_BLOCK

  max_concurrent_steps: int = 4
  compute_wgs: int = NUM_COMPUTE_WGS
  persistent: bool | None = None
  k_blocks_per_step: int = 1

  def __post_init__(self):
    self.pipeline  # Validates the depth.  # noqa: B018
    if self.compute_wgs not in (1, NUM_COMPUTE_WGS, NUM_COMPUTE_WGS + 1):
      raise ValueError(f"compute_wgs={self.compute_wgs!r} must be 1, {NUM_COMPUTE_WGS} or "
                       f"{NUM_COMPUTE_WGS + 1}")
    if self.persistent and self.compute_wgs == 1:
      raise ValueError("persistent=True needs compute_wgs > 1 (a memory warpgroup), got "
                       f"compute_wgs={self.compute_wgs}")
    if self.persistent is False and self.compute_wgs > NUM_COMPUTE_WGS:
      raise ValueError(f"compute_wgs={self.compute_wgs} runs only on the persistent kernel, "
                       "got persistent=False")
    if self.k_blocks_per_step not in (1, 2):
      raise ValueError(f"k_blocks_per_step={self.k_blocks_per_step!r} must be 1 or 2")
    if self.k_blocks_per_step > 1 and not self.runs_persistent:
      raise ValueError(f"k_blocks_per_step={self.k_blocks_per_step} needs the persistent "
                       f"kernel, got {self!r}")
    if self.k_blocks_per_step > 1 and self.compute_wgs > NUM_COMPUTE_WGS:
      # Two accumulators and the running sum take 192 registers a thread,
      # beyond the 160 each of three compute warpgroups gets.
      raise ValueError(f"k_blocks_per_step={self.k_blocks_per_step} needs compute_wgs <= "
                       f"{NUM_COMPUTE_WGS}, got compute_wgs={self.compute_wgs}")

  @property
  def runs_persistent(self) -> bool:
    """Whether the kernel is the persistent one: `persistent`, or by default
    whether there is a memory warpgroup."""
    if self.persistent is None:
      return self.compute_wgs > 1
    return self.persistent

  @property
  def tile_order(self) -> TuningConfig:
    """The persistent kernel's tile order: `matmul`'s default (`for_each_work_item`
    reads its grid order, band width, K splits and clusters)."""
    return TuningConfig(tile_m=self.TILE_M, tile_n=self.TILE_N, tile_k=self.TILE_K)

  @property
  def cta_tile_m(self) -> int:
    return self.compute_wgs * self.TILE_M

  @property
  def pipeline(self) -> PipelineOptions:
    return PipelineOptions(max_concurrent_steps=self.max_concurrent_steps)

  def blocks_per_step(self, k_blocks: int) -> int:
    """The scale blocks a pipeline step takes on a K of `k_blocks` blocks:
    `k_blocks_per_step` where it divides them, else 1."""
    return self.k_blocks_per_step if k_blocks % self.k_blocks_per_step == 0 else 1

  def smem_budget(self, k_steps: int, out_dtype, *, has_bias: bool,
                  rhs_row_scales: bool = False) -> SmemBudget:
    """The SMEM of a problem of `k_steps` K steps: the operand and LHS-scale
    slots and the RHS's scales for the tile's column block (and its bias)
    through the K loop, then the output's staging tile. With
    `rhs_row_scales` the RHS's scales are one per row, in slots beside the
    LHS's."""
    blocks = self.blocks_per_step(k_steps)
    steps = self.pipeline.steps_for(k_steps // blocks)
    cta_m = self.cta_tile_m
    tile_constants = []
    if not rhs_row_scales:
      tile_constants.append(SmemBuffer(name="rhs_scales_smem",
                                       shape=(self.scale_row_length(k_steps),), dtype=jnp.float32))
    if has_bias:
      tile_constants.append(SmemBuffer(name="bias_smem", shape=(self.TILE_N,),
                                       dtype=jnp.float32))
    width = blocks * self.TILE_K
    slots = (SmemBuffer(name="lhs_smem", shape=(cta_m, width), dtype=FP8_DTYPE, copies=steps),
             SmemBuffer(name="rhs_smem", shape=(self.TILE_N, width), dtype=FP8_DTYPE,
                        copies=steps),
             SmemBuffer(name="lhs_scales_smem", shape=(blocks, cta_m), dtype=jnp.float32,
                        copies=steps))
    if rhs_row_scales:
      slots += (SmemBuffer(name="rhs_scales_smem", shape=(blocks, self.TILE_N),
                           dtype=jnp.float32, copies=steps),)
    constants_barriers = 1 if tile_constants else 0
    out_smem = [SmemBuffer(name="out_smem", shape=(cta_m, self.TILE_N), dtype=out_dtype)]
    if jnp.dtype(out_dtype) == FP8_DTYPE:  # And its scales, one per row.
      out_smem.append(SmemBuffer(name="out_scales_smem", shape=(self.compute_wgs, 1, self.TILE_M),
                                 dtype=jnp.float32))
    if self.compute_wgs == 1:
      # The K loop, then the epilogue's staging tiles in a scope of their
      # own; one TMA-completion barrier per slot, one for the tile's constants.
      return SmemBudget(phases=((*slots, *tile_constants), (*tile_constants, *out_smem)),
                        num_barriers=steps + constants_barriers)
    if self.runs_persistent:
      # Each compute warpgroup keeps its own copy of the tile's constants, each
      # row padded to 128 bytes, with its own barrier.
      tile_constants = [dataclasses.replace(
          buffer, shape=(self.compute_wgs, self.constants_row_length(buffer.shape[0])))
          for buffer in tile_constants]
      return SmemBudget(phases=((*slots, *tile_constants, *out_smem),),
                        num_barriers=2 * steps + self.compute_wgs * constants_barriers)
    # Every warpgroup's staging tiles are allocated beside the pipeline; each
    # slot has a loaded and a consumed barrier.
    return SmemBudget(phases=((*slots, *tile_constants, *out_smem),),
                      num_barriers=2 * steps + constants_barriers)

  @staticmethod
  def constants_row_length(length: int) -> int:
    """A warpgroup's row of a tile's float32 constants in the persistent
    kernel, padded to 128 bytes: a TMA copy's SMEM destination starts on 128
    bytes, and each warpgroup's row is one."""
    return -(-length // 32) * 32

  @staticmethod
  def scale_row_length(k_steps: int) -> int:
    """The length a row of the RHS's scales is padded to (`k_steps` scales,
    then ones): a TMA copy moves whole 16-byte units."""
    return -(-k_steps // 4) * 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelinedConfig:
  """The `emit_pipeline` matmul: one warpgroup per (tile_m, tile_n) output tile.

  Attributes:
    tile_m, tile_n, tile_k: block of the output and the K step.
    max_concurrent_steps: SMEM slots per operand (clamped to the K steps).
    delay_release: wgmma groups left in flight per step (0 up to
      max_concurrent_steps - 1): the pipeline holds each slot that many extra
      steps before refilling it.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int = 4
  delay_release: int = 1

  def __post_init__(self):
    _check_tiles(self.tile_m, self.tile_n, self.tile_k)
    self.pipeline  # Validates the depth against delay_release.  # noqa: B018

  @property
  def pipeline(self) -> PipelineOptions:
    return PipelineOptions(max_concurrent_steps=self.max_concurrent_steps,
                           delay_release=self.delay_release)

  def smem_budget(self, k: int, dtype, out_dtype) -> SmemBudget:
    steps = self.pipeline.steps_for(k // self.tile_k)
    return SmemBudget(
        phases=(
            # The K loop, then the epilogue in a scope of its own.
            (SmemBuffer(name="lhs_smem", shape=(self.tile_m, self.tile_k), dtype=dtype,
                        copies=steps),
             SmemBuffer(name="rhs_smem", shape=(self.tile_k, self.tile_n), dtype=dtype,
                        copies=steps)),
            (SmemBuffer(name="out_smem", shape=(self.tile_m, self.tile_n), dtype=out_dtype),),
        ),
        num_barriers=steps,  # One TMA-completion barrier per slot.
    )

  def pallas_call_smem_budget(self, k: int, dtype, out_dtype) -> SmemBudget:
    """SMEM `pallas_call_matmul` allocates for K = `k` (all of it alive at once).

    Its pipeline also stages the output block in every slot, and the float32
    partial sum is kernel-level SMEM scratch.
    """
    steps = self.pipeline.steps_for(k // self.tile_k)
    return SmemBudget(
        phases=((
            SmemBuffer(name="acc_smem", shape=(self.tile_m, self.tile_n), dtype=jnp.float32),
            SmemBuffer(name="lhs_smem", shape=(self.tile_m, self.tile_k), dtype=dtype,
                       copies=steps),
            SmemBuffer(name="rhs_smem", shape=(self.tile_k, self.tile_n), dtype=dtype,
                       copies=steps),
            SmemBuffer(name="out_smem", shape=(self.tile_m, self.tile_n), dtype=out_dtype,
                       copies=steps),
        ),),
        num_barriers=steps,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuningConfig:
  """The warp-specialized persistent matmul.

  Two compute warpgroups each own a (tile_m, tile_n) accumulator. Under the
  cooperative schedule they cover a CTA tile twice as large along
  `wg_dimension`; under ping-pong each takes every other CTA tile. A third
  warpgroup only issues TMA loads.

  Attributes:
    tile_m, tile_n, tile_k: per-warpgroup output tile and the K step.
    max_concurrent_steps: SMEM slots per operand. Cooperative: clamped to
      the K steps of a tile. Ping-pong: not clamped, since the ring carries
      on into the next tile's K steps.
    epi_tile_m, epi_tile_n: the epilogue stores the accumulator through SMEM in
      tiles of this size (double-buffered), so the next tile's loads can use
      the SMEM the epilogue does not hold.
    grid_minor_dim: the output dimension consecutive tiles advance along.
    grid_tile_width: tiles along `grid_minor_dim` before stepping the other
      dimension (a band this wide shares operands in L2).
    wg_dimension: the dimension the two compute warpgroups split (cooperative
      schedule only).
    schedule: see `Schedule`.
    k_splits: blocks that share each output tile's K loop (cooperative
      schedule only). With more than one, each computes a range of
      `split_k_steps` K steps (the last range may run past K, where TMA
      reads zeros, so K needs no padding) and stores a float32 partial
      tile; XLA then sums the
      partials and applies the bias and activation in one pass over
      k_splits * M * N * 4 bytes. Worth it where the output has too few
      tiles to occupy the SMs and K is long (e.g. M = 512, N = 1024).
    rhs_tile_n: the width of each RHS SMEM tile (cooperative schedule), a
      divisor of tile_n; None for tile_n. Each compute warpgroup issues one
      wgmma per RHS tile of its columns, into an accumulator of its own. At
      64 (one swizzle segment of 16-bit data) TMA copies each tile as a box,
      which it masks at any N whose rows are on 16 bytes: a (K, N) RHS with
      N = 3000 is read in place by CTA tiles of any width.
    cluster_m: CTAs per cluster along M, 1 or 2 (cooperative schedule). With
      2, the CTAs of a cluster compute vertically adjacent tiles of the same
      columns, and TMA multicasts each RHS tile to both: the RHS is read from
      L2 half as often, which is what a (K, N) RHS read in place with rows off
      128 bytes needs (each row of a tile then spans one more 128-byte line).
    swap_operands: the kernel computes the transposed product, out.T =
      op(rhs).T @ op(lhs).T, in float32, the RHS read as stored and the LHS's
      rows as an (N', K) RHS (a (K, M) LHS transposed by XLA first:
      `MatmulProblem.transposed_product`), and XLA transposes it in the pass that
      sums the partials of a split K and applies the bias, activation and
      cast (`ws_matmul` only). The other fields are that product's config.
      It serves decode-size M: an (M, K) LHS of a few rows becomes an
      (N', K) RHS read in 16-row tiles, where as the LHS its 64-row tiles
      reach past M, and TMA loads of rows past an array's end are slow
      (16x4096x4096 on an H100: the kernel took 11.0 us, 7.5 us with the
      LHS zero-padded to 64 rows).
    transpose_rhs_first: a (K, N) RHS is transposed by XLA before the kernel,
      which reads it as (N, K) rows (`ws_matmul` only; no effect on an RHS
      stored (N, K); not with `swap_operands`). It serves outputs at most 16
      columns wide: a (K, N) RHS of so few columns is rows of 16-32 bytes,
      read in a narrow swizzle, where (N, K) rows are whole 128-byte
      segments along K under 16-column tiles. The copy is N x K elements.
    chain_tiles: cooperative schedule: a block's tiles share one ring of
      operand slots (`plgpu.emit_pipeline_warp_specialized`'s
      `pipeline_state`), so the memory warpgroup loads a tile's first K steps
      while the compute warpgroups finish the one before and store it.
      Without it the memory warpgroup waits at the end of each tile until
      every slot is released, and the next tile's first loads start only
      then. Takes effect only where a tile's K steps are a multiple of
      `max_concurrent_steps` (the ring's slots then line up across tiles)
      and K is static: not in a grouped weight gradient (`ragged_k`) nor
      under a pipeline callback. Off by default: on an H100 it ran 1-2%
      faster than the unchained pipeline at the same depth, less than a
      depth that does not divide the K steps can gain.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int = 4
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  grid_minor_dim: MatmulDimension = MatmulDimension.M
  grid_tile_width: int = 8
  wg_dimension: MatmulDimension = MatmulDimension.N
  schedule: Schedule = Schedule.COOPERATIVE
  k_splits: int = 1
  rhs_tile_n: int | None = None
  cluster_m: int = 1
  swap_operands: bool = False
  transpose_rhs_first: bool = False
  chain_tiles: bool = False

  def __post_init__(self):
    _check_tiles(self.tile_m, self.tile_n, self.tile_k)
    PipelineOptions(max_concurrent_steps=self.max_concurrent_steps, delay_release=0)
    if not isinstance(self.k_splits, int) or self.k_splits < 1:
      raise ValueError(f"k_splits={self.k_splits!r} must be an int >= 1")
    if self.k_splits > 1 and self.schedule != Schedule.COOPERATIVE:
      raise ValueError(f"k_splits={self.k_splits} needs schedule=Schedule.COOPERATIVE, "
                       f"not {self.schedule!r}")
    _check_positive_multiple("epi_tile_m", self.epi_tile_m, WGMMA_M)
    _check_positive_multiple("epi_tile_n", self.epi_tile_n, WGMMA_N_MULTIPLE)
    if self.tile_m % self.epi_tile_m or self.tile_n % self.epi_tile_n:
      raise ValueError(
          f"epilogue tile ({self.epi_tile_m}, {self.epi_tile_n}) must divide the "
          f"warpgroup tile ({self.tile_m}, {self.tile_n})")
    if self.rhs_tile_n is not None:
      _check_positive_multiple("rhs_tile_n", self.rhs_tile_n, WGMMA_N_MULTIPLE)
      if self.tile_n % self.rhs_tile_n or self.rhs_tile_n % self.epi_tile_n:
        raise ValueError(f"rhs_tile_n={self.rhs_tile_n} must divide tile_n={self.tile_n} and be "
                         f"a multiple of epi_tile_n={self.epi_tile_n}")
    for name in ("swap_operands", "transpose_rhs_first", "chain_tiles"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
    if self.swap_operands and self.transpose_rhs_first:
      raise ValueError("swap_operands and transpose_rhs_first exclude each other: the "
                       "transposed product reads the LHS's rows as its RHS")
    if self.cluster_m not in CLUSTER_SIZES:
      raise ValueError(f"cluster_m={self.cluster_m!r} must be one of {CLUSTER_SIZES}")
    # Ping-pong's ring of slots already runs across tiles (`chain_tiles`).
    for name, default in (("rhs_tile_n", None), ("cluster_m", 1), ("chain_tiles", False)):
      if getattr(self, name) != default and self.schedule != Schedule.COOPERATIVE:
        raise ValueError(f"{name}={getattr(self, name)} needs schedule=Schedule.COOPERATIVE, "
                         f"not {self.schedule!r}")
    if not isinstance(self.grid_tile_width, int) or self.grid_tile_width < 1:
      raise ValueError(f"grid_tile_width={self.grid_tile_width!r} must be an int >= 1")
    for name in ("grid_minor_dim", "wg_dimension"):
      if not isinstance(getattr(self, name), MatmulDimension):
        raise ValueError(f"{name}={getattr(self, name)!r} must be a MatmulDimension")
    if not isinstance(self.schedule, Schedule):
      raise ValueError(f"schedule={self.schedule!r} must be a Schedule")
    per_array = self.slot_barrier_sets * self.max_concurrent_steps
    if per_array > MAX_BARRIERS_PER_ARRAY:
      raise ValueError(
          f"max_concurrent_steps={self.max_concurrent_steps} is too deep for {self.schedule!r}: "
          f"an array of its slots' barriers would hold {per_array}, "
          f"and Mosaic GPU allows {MAX_BARRIERS_PER_ARRAY}, so at most "
          f"{MAX_BARRIERS_PER_ARRAY // self.slot_barrier_sets} slots")

  @property
  def cta_tile_m(self) -> int:
    return self.tile_m * (NUM_COMPUTE_WGS if self._split(MatmulDimension.M) else 1)

  @property
  def cta_tile_n(self) -> int:
    return self.tile_n * (NUM_COMPUTE_WGS if self._split(MatmulDimension.N) else 1)

  @property
  def rhs_tile_width(self) -> int:
    """The columns of each RHS SMEM tile: `rhs_tile_n`, or tile_n."""
    return self.tile_n if self.rhs_tile_n is None else self.rhs_tile_n

  @property
  def rhs_tiles(self) -> int:
    """RHS SMEM tiles per CTA tile, each (tile_k, rhs_tile_width): at least
    one per compute warpgroup where they split N (cooperative schedule).

    Loaded apart, a tile one swizzle segment wide (64 columns of 16-bit data)
    is copied as a box, which TMA masks at any N whose rows start on 16
    bytes (`core.tma_copies_in_place`): no padding copy of a (K, N) RHS with
    N = 3000, where one (tile_k, 128) tile would need one.
    """
    return self.cta_tile_n // self.rhs_tile_width

  @property
  def rhs_tiles_per_wg(self) -> int:
    """RHS tiles each compute warpgroup multiplies by: one wgmma and one
    accumulator each."""
    return self.tile_n // self.rhs_tile_width

  def _split(self, dimension: MatmulDimension) -> bool:
    return self.schedule == Schedule.COOPERATIVE and self.wg_dimension == dimension

  def split_k_steps(self, k: int) -> int:
    """K steps in each of the `k_splits` ranges of a K of `k` (`k_range_steps`)."""
    return k_range_steps(k, self.tile_k, self.k_splits)

  def store_dtype(self, out_dtype) -> jnp.dtype:
    """What the kernel stores: `out_dtype`, or float32 partials when K is split."""
    return jnp.dtype(jnp.float32 if self.k_splits > 1 else out_dtype)

  @property
  def fuses_epilogue(self) -> bool:
    """Whether bias and activation run in the kernel (else in XLA, after the
    partials of a split K are summed)."""
    return self.k_splits == 1

  @property
  def slot_barrier_sets(self) -> int:
    """Each slot has a "loaded" and a "consumed" barrier, once per compute
    warpgroup under ping-pong (where both warpgroups use each slot in turn)."""
    return NUM_COMPUTE_WGS if self.schedule == Schedule.PINGPONG else 1

  @property
  def epilogue_slots(self) -> int:
    """SMEM staging slots per warpgroup: 2 lets one store drain while the next fills."""
    return min(2, (self.tile_m // self.epi_tile_m) * (self.tile_n // self.epi_tile_n))


def check_tuning_config(config) -> None:
  """Raises, naming the argument, unless `config` is a `TuningConfig`."""
  if not isinstance(config, TuningConfig):
    raise ValueError(f"config must be a TuningConfig, got {type(config).__name__}")


def check_operand_dtype(name: str, dtype, allowed: tuple = OPERAND_DTYPES) -> jnp.dtype:
  dtype = jnp.dtype(dtype)
  if dtype not in allowed:
    raise ValueError(f"{name}.dtype={dtype.name} is not supported; use one of "
                     f"{[d.name for d in allowed]}")
  return dtype


def operand_tile_minor_dims(config, *, transpose_lhs: bool = False,
                            transpose_rhs: bool = False) -> tuple[int, int]:
  """The minor (contiguous) dimension, in elements, of the LHS and RHS SMEM tiles.

  A tile is stored as its operand is: the LHS tile is (cta_m, tile_k), or
  (tile_k, cta_m) when the LHS is stored (K, M); each RHS tile
  (`TuningConfig.rhs_tiles`) is (tile_k, rhs_tile_width), or
  (rhs_tile_width, tile_k) when the RHS is stored (N, K).
  """
  cta_tile_m = getattr(config, "cta_tile_m", config.tile_m)
  rhs_tile_n = getattr(config, "rhs_tile_width", config.tile_n)
  return (cta_tile_m if transpose_lhs else config.tile_k,
          config.tile_k if transpose_rhs else rhs_tile_n)


def operand_swizzle(config, lhs_gmem, rhs_gmem, *, transpose_lhs: bool = False,
                    transpose_rhs: bool = False) -> int:
  """The swizzle (bytes) of both operands' SMEM tiles: the widest that the
  tiles and the stored arrays' minor dimensions allow (`core.tma_swizzle`;
  wgmma reads both operands with one swizzle)."""
  tile_minor_dims = operand_tile_minor_dims(config, transpose_lhs=transpose_lhs,
                                            transpose_rhs=transpose_rhs)
  return tma_swizzle(tile_minor_dims, (lhs_gmem.shape[-1], rhs_gmem.shape[-1]), lhs_gmem.dtype)


def check_swizzle(config, dtype, *, transpose_lhs: bool = False,
                  transpose_rhs: bool = False) -> None:
  """Raises if the operand tiles cannot be swizzled for TMA + wgmma.

  wgmma reads both operands with one swizzle. The warp-specialized kernels
  (`TuningConfig`) give both tiles the widest swizzle that both allow
  (`operand_swizzle`), so their tiles' rows may differ (a 32-element K step
  of 16-bit data with 128-column RHS tiles takes 64 bytes). The pipelined
  kernels (`PipelinedConfig`) give each tile the widest swizzle its own rows
  allow, so there the two must agree.
  """
  itemsize = jnp.dtype(dtype).itemsize
  name = jnp.dtype(dtype).name
  lhs_minor, rhs_minor = operand_tile_minor_dims(config, transpose_lhs=transpose_lhs,
                                                 transpose_rhs=transpose_rhs)
  lhs_what = "lhs tile (tile_m of a (K, M) lhs)" if transpose_lhs else "lhs tile (tile_k)"
  rhs_what = "rhs tile (tile_k of an (N, K) rhs)" if transpose_rhs else "rhs tile (tile_n)"
  lhs_swizzle = swizzle_bytes(lhs_minor, dtype, what=lhs_what)
  rhs_swizzle = swizzle_bytes(rhs_minor, dtype, what=rhs_what)
  if lhs_swizzle != rhs_swizzle and not isinstance(config, TuningConfig):
    # Mosaic GPU's wgmma reads both SMEM operands with one swizzle; otherwise
    # its layout inference fails with no hint of the cause.
    if not (transpose_lhs or transpose_rhs):
      raise ValueError(
          f"tile_k={config.tile_k} gives {name} LHS tiles a {lhs_swizzle}-byte "
          f"swizzle but the {rhs_minor}-wide RHS tile gets {rhs_swizzle} bytes; wgmma needs "
          f"one swizzle for both: use tile_k={rhs_swizzle // itemsize}, or a tile_n that is a "
          f"multiple of {lhs_swizzle // itemsize}")
    raise ValueError(
        f"{config!r}: the {name} LHS tile's {lhs_minor}-element rows get a {lhs_swizzle}-byte "
        f"swizzle but the RHS tile's {rhs_minor}-element rows get {rhs_swizzle} bytes; wgmma "
        f"needs one swizzle for both: make both minor dimensions multiples of "
        f"{max(lhs_swizzle, rhs_swizzle) // itemsize}")
  segment = min(lhs_swizzle, rhs_swizzle) // itemsize
  if config.tile_k % segment:
    # wgmma steps through K in groups one swizzled segment long; where
    # neither tile's rows run along K (a (K, M) lhs with a (K, N) rhs), the
    # segment is set by M and N.
    raise ValueError(
        f"tile_k={config.tile_k} must be a multiple of {segment} for this layout: both "
        f"{name} operand tiles take a {segment * itemsize}-byte swizzle (the {lhs_what} is "
        f"{lhs_minor} wide, the {rhs_what} {rhs_minor}), and wgmma steps through K in "
        f"{segment}-element groups")
  # Each warpgroup's wgmma reads its part of the CTA's LHS tile; split along
  # the tile's minor dimension, that part must start at a swizzled segment
  # (of the widest swizzle both tiles allow: a narrower one divides it).
  # Warpgroups that split N each load an RHS tile of their own.
  splits_m = getattr(config, "cta_tile_m", config.tile_m) != config.tile_m
  if splits_m and transpose_lhs and config.tile_m % segment:
    raise ValueError(
        f"tile_m={config.tile_m} must be a multiple of {segment} when the warpgroups split M "
        f"(wg_dimension=MatmulDimension.M) of a (K, M) lhs: each reads its columns of a "
        f"{lhs_minor}-wide {name} LHS tile swizzled in {segment}-column segments")
