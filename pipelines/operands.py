"""Checks on matmul operands, their stored layouts, and the padding TMA needs.

Shared by every matmul wrapper and run before tracing. A matmul computes
`op(lhs) @ op(rhs)` where each operand may be stored transposed
(`OperandLayout`): the LHS as (K, M), the RHS as (N, K). The kernels read
either layout straight from HBM and hand wgmma a transposed SMEM view, so
`x.T @ y` and `x @ y.T` need no transpose copy.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from core import tma_copies_in_place, tma_swizzle
from core.memory import SWIZZLE_BYTES, TILE_ROWS
from pipelines.config import OPERAND_DTYPES, check_operand_dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class OperandLayout:
  """How the operands are stored.

  Attributes:
    transpose_lhs: the LHS is stored (K, M) instead of (M, K).
    transpose_rhs: the RHS is stored (N, K) instead of (K, N).
  """

  transpose_lhs: bool = False
  transpose_rhs: bool = False

  @property
  def name(self) -> str:
    """BLAS-style: "NN", "TN" (LHS transposed), "NT" (RHS transposed) or "TT"."""
    return "TN"[not self.transpose_lhs] + "TN"[not self.transpose_rhs]

  def lhs_shape(self, m: int, k: int) -> tuple[int, int]:
    return (k, m) if self.transpose_lhs else (m, k)

  def rhs_shape(self, k: int, n: int) -> tuple[int, int]:
    return (n, k) if self.transpose_rhs else (k, n)

  @property
  def dimension_numbers(self):
    """`lax.dot_general`'s dimension numbers for `op(lhs) @ op(rhs)` on the
    operands as stored (each contracted along its stored K, nothing batched)."""
    return ((0 if self.transpose_lhs else 1,), (1 if self.transpose_rhs else 0,)), ((), ())


NN = OperandLayout()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MatmulProblem:
  """out[m, n] = sum_k op(lhs)[m, k] * op(rhs)[k, n], with 16-bit operands."""

  m: int
  k: int
  n: int
  dtype: jnp.dtype
  layout: OperandLayout = NN

  @property
  def flops(self) -> int:
    return 2 * self.m * self.k * self.n

  @property
  def is_empty(self) -> bool:
    """Whether M, N or K is 0: the product is all zeros (or has no elements)."""
    return not (self.m and self.k and self.n)

  def with_rhs_transposed(self) -> MatmulProblem:
    """The same product with its RHS stored (N, K) (`TuningConfig.transpose_rhs_first`)."""
    return dataclasses.replace(self, layout=dataclasses.replace(self.layout, transpose_rhs=True))

  def transposed_product(self) -> MatmulProblem:
    """The problem of the kernel that runs out.T = op(rhs).T @ op(lhs).T
    (`TuningConfig.swap_operands`), (N, K, M): the RHS array is its LHS, read
    as stored (a (K, N) RHS is a (K, M') LHS), and the LHS's rows its (N', K)
    RHS. An (M, K) LHS is read as stored; a (K, M) one is transposed by XLA
    first (`kernel_call.ws_matmul`): at the few rows this product is for, a
    (K, N') RHS would be rows of 2-32 bytes, read in narrow swizzles."""
    layout = OperandLayout(transpose_lhs=not self.layout.transpose_rhs, transpose_rhs=True)
    return dataclasses.replace(self, m=self.n, n=self.m, layout=layout)


def check_operands(lhs, rhs, layout: OperandLayout = NN,
                   dtypes: tuple = OPERAND_DTYPES) -> MatmulProblem:
  """Validates `lhs` and `rhs` stored as `layout` says; raises `ValueError` naming the argument.

  Any M, K and N (0 included) are valid: wrappers pad what their kernel needs.
  `dtypes`: the operand dtypes the caller's kernel takes.
  """
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if x.ndim != 2:
      raise ValueError(f"{name} must be 2-D (use jax.vmap for a batch), got {name}.shape={x.shape}")
  check_operand_dtype("lhs", lhs.dtype, dtypes)
  check_operand_dtype("rhs", rhs.dtype, dtypes)
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"lhs and rhs dtypes differ: {lhs.dtype=}, {rhs.dtype=}")
  k, m = lhs.shape if layout.transpose_lhs else lhs.shape[::-1]
  n, k2 = rhs.shape if layout.transpose_rhs else rhs.shape[::-1]
  if k != k2:
    stored = (f"lhs stored as {'(K, M)' if layout.transpose_lhs else '(M, K)'}, rhs as "
              f"{'(N, K)' if layout.transpose_rhs else '(K, N)'}")
    raise ValueError(f"K of lhs and rhs differ: {lhs.shape=}, {rhs.shape=} ({stored})")
  return MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(lhs.dtype), layout=layout)


def check_out_dtype(out_dtype, default) -> jnp.dtype:
  out_dtype = jnp.dtype(default if out_dtype is None else out_dtype)
  if out_dtype not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise ValueError(f"out_dtype={out_dtype.name} must be float16, bfloat16 or float32")
  return out_dtype


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def pad_k(problem: MatmulProblem, k_multiple: int) -> MatmulProblem:
  """`problem` with K rounded up to a multiple of `k_multiple` (see `pad_operands`)."""
  return dataclasses.replace(problem, k=round_up(problem.k, k_multiple))


# What a narrower swizzle costs the main loop, against the widest: measured on
# an H200 with the same config in place and on pre-padded operands
# (docs/performance-log.md, "Why the pads existed, and what was changed"): 64 bytes
# 1.13x at 4096x4096x4000 and 1.20x at
# 104x8192x4000; 32 bytes 2.1x at 4096x4112x4096.
_SWIZZLE_SLOWDOWN = {128: 1.0, 64: 1.2, 32: 2.1}
# To weigh that against a padding copy: the kernel's time from its FLOPs at
# the rate it sustains on an H200 (700-760 TFLOP/s on large problems) or
# its HBM traffic, and a copy's from the bytes it reads and writes (3.0 TB/s
# measured for the pads of 100x8192x4000 and 4999x4096x2500) plus a launch.
_KERNEL_FLOPS_PER_US = 7.0e8
_KERNEL_BYTES_PER_US = 4.0e6
_COPY_BYTES_PER_US = 3.0e6
_COPY_LAUNCH_US = 2.0
# A (K, N) RHS copied as one-segment boxes is read again by every row of CTA
# tiles, and rows that start off a 32-byte L2 sector take one more sector
# each time. On an H200, reading such an RHS in place (N = 3000, 1000, 4040)
# ran 1.1-2.0x faster than padding it at M <= 256 (the padding copy of the
# whole RHS dominates there), but 1.19x slower at 1000x4096x1000 and 1.04x
# at 700x8192x3000 (docs/performance-log.md, "Each warpgroup's own RHS tile"). Beyond this
# M it is padded.
_MAX_M_RHS_BOXES_OFF_SECTOR = 256
_L2_SECTOR_BYTES = 32


def main_loop_us(problem: MatmulProblem, out_dtype, swizzle: int) -> float:
  """The modelled time (us, H200) of a kernel's main loop on `problem` with its
  operand tiles under `swizzle` (bytes): its FLOPs or its HBM traffic,
  whichever takes longer, slowed by a swizzle narrower than 128 bytes."""
  out_bytes = problem.m * problem.n * jnp.dtype(out_dtype).itemsize
  operand_bytes = (problem.m + problem.n) * problem.k * problem.dtype.itemsize
  return _SWIZZLE_SLOWDOWN[swizzle] * max(problem.flops / _KERNEL_FLOPS_PER_US,
                                          (operand_bytes + out_bytes) / _KERNEL_BYTES_PER_US)


def copy_us(shape: tuple[int, ...], dtype) -> float:
  """The modelled time (us, H200) of an XLA copy that writes an array of
  `shape` and `dtype`, as a pad or a slice does: its bytes read and written,
  plus a launch."""
  return 2 * math.prod(shape) * jnp.dtype(dtype).itemsize / _COPY_BYTES_PER_US + _COPY_LAUNCH_US


@dataclasses.dataclass(frozen=True, kw_only=True)
class TmaSizes:
  """The shapes a kernel's arrays are zero-padded to (`tma_sizes`).

  Attributes:
    lhs, rhs: the operands' stored shapes (as `MatmulProblem.layout` stores
      them). Their K may differ: TMA fills the K past either array with zeros.
    out: the (M, N) the kernel writes; the caller slices the result.
  """

  lhs: tuple[int, int]
  rhs: tuple[int, int]
  out: tuple[int, int]


def tma_sizes(problem: MatmulProblem, *, out_dtype, k_multiple: int, tile_m: int, tile_n: int,
              copy_tiles: tuple[int, int], out_tile_n: int,
              swizzles: tuple[int, ...] = SWIZZLE_BYTES, rhs_multicast: bool = False) -> TmaSizes:
  """The shapes the operands and the output are zero-padded to for a kernel's TMA copies.

  Mosaic GPU's TMA tiles a GMEM array as its SMEM tile: an array's major
  dimension must be a multiple of the tile's 8 rows, its minor one of the
  swizzle's row segment (`core.tma_swizzle`: both operands take one, the
  widest of `swizzles` that their minor dimensions allow). TMA masks the
  partial edge tiles and fills the K past an array's end with zeros, so K
  need be a multiple of the K tile only where `k_multiple` says (the
  single-warpgroup `emit_pipeline` kernel).

  An array whose SMEM tile is one segment wide (the (M, K) LHS under
  64-element float16 K steps, a (K, N) RHS under 64-column warpgroup tiles,
  a 16-bit output under 64-column epilogue tiles) is copied as plain 2D
  boxes, which TMA masks at every edge (`core.tma_copies_in_place`): it is
  never padded unless its rows are off 16 bytes (an odd N of a float16
  output), or it is a (K, N) RHS with rows off 32 bytes, M over
  `_MAX_M_RHS_BOXES_OFF_SECTOR` and no multicast (`rhs_multicast`).

  Any other operand whose minor dimension is off the widest segment is
  either read in place with a narrower swizzle, which slows the whole main
  loop (`_SWIZZLE_SLOWDOWN`), or padded to the widest, a copy of that
  operand: whichever the cost model says is faster (N = 4000 at M = 100
  reads the 65 MB RHS with a 64-byte swizzle, which makes the LHS tiles of
  64-element K steps two segments wide and pads its M to 104; the
  heuristic takes 32-element steps there, one segment). A minor dimension
  off the narrowest segment is always padded. Only swizzles whose segments
  divide both operand tiles' rows are considered.

  A tile wider than the whole of its array's minor dimension is not masked
  correctly by tiled copies, though: on an H200, N = 64 under 128-wide CTA
  tiles gave wrong products whenever K took two steps or more (relative
  error 0.7-1.0; M below the tile, as a major dimension, was right); with
  that padding dropped for arrays that could be boxes but fit tiles (an
  N = 64 output, say), 10 GPU tests failed, ragged M and N among them at
  relative error 1.0. So a minor M or N is padded to at least its tile
  wherever the array is copied tiled (boxes are used only where tiles would
  not fit).

  Args:
    problem: the problem and how its operands are stored.
    out_dtype: the dtype the kernel stores.
    k_multiple: K is rounded up to a multiple of this.
    tile_m, tile_n: the CTA tile.
    copy_tiles: the minor dimensions of the LHS and RHS SMEM tiles TMA
      copies (`config.operand_tile_minor_dims`).
    out_tile_n: the minor dimension of the tiles the kernel stores.
    swizzles: the swizzles (bytes) the kernel's tiles may take.
    rhs_multicast: whether the kernel multicasts each RHS tile to a cluster
      of two blocks (`TuningConfig.cluster_m`), which halves its L2 reads.
  """
  layout, dtype = problem.layout, problem.dtype
  widest, narrowest = max(swizzles), min(swizzles)
  k = round_up(problem.k, k_multiple)

  def padded(shape: tuple[int, int], array_dtype, swizzle: int, copy_tile: int,
             minor_tile: int, boxes: bool = True):
    # `copy_tile`: the minor dimension of the SMEM tiles TMA copies;
    # `minor_tile`: of the CTA tile, which the array must not be narrower than;
    # `boxes`: whether one-segment tiles may be copied as boxes.
    major, minor = shape
    itemsize = jnp.dtype(array_dtype).itemsize
    in_place = tma_copies_in_place(copy_tile, minor, array_dtype, swizzle) and (
        boxes or minor * itemsize % swizzle == 0)
    if copy_tile * itemsize == swizzle and in_place:
      if major % TILE_ROWS or minor % copy_tile:
        return shape  # Copied as boxes.
      # Copied tiled, as Mosaic GPU does where it can.
      return major, max(minor, minor_tile)
    if not in_place:
      minor = round_up(minor, widest // itemsize)
    return round_up(major, TILE_ROWS), max(minor, minor_tile)

  stored = (layout.lhs_shape(problem.m, k), layout.rhs_shape(k, problem.n))
  # The minor dimensions of the operands' CTA tiles (a minor K has no such
  # floor: TMA fills the K past the array with zeros).
  minor_tiles = (tile_m if layout.transpose_lhs else 1, 1 if layout.transpose_rhs else tile_n)
  rhs_boxes = (layout.transpose_rhs or rhs_multicast
               or problem.m <= _MAX_M_RHS_BOXES_OFF_SECTOR
               or problem.n * dtype.itemsize % _L2_SECTOR_BYTES == 0)
  padded_k = dataclasses.replace(problem, k=k)
  # Both operand tiles take one swizzle (`config.operand_swizzle`), which
  # their rows must be whole segments of: a 32-element float16 K step allows
  # 64 bytes at most, so no array is padded for a 128-byte swizzle it cannot take.
  operand_swizzles = [swizzle for swizzle in swizzles
                      if all(tile * dtype.itemsize % swizzle == 0 for tile in copy_tiles)]
  options = []
  for swizzle in sorted(operand_swizzles, reverse=True):
    shapes = tuple(padded(shape, dtype, swizzle, copy_tile, minor_tile, boxes)
                   for shape, copy_tile, minor_tile, boxes in zip(
                       stored, copy_tiles, minor_tiles, (True, rhs_boxes), strict=True))
    copies_us = sum(copy_us(new, dtype) for old, new in zip(stored, shapes, strict=True)
                    if new != old)
    options.append((main_loop_us(padded_k, out_dtype, swizzle) + copies_us, shapes))
  # min() keeps the widest swizzle of equal costs.
  _, (lhs, rhs) = min(options, key=lambda option: option[0])
  # The output takes the widest swizzle its tiles fit (`epilogue.output_swizzle`).
  try:
    out_swizzle = tma_swizzle((out_tile_n,), (problem.n,), out_dtype, swizzles)
  except ValueError:  # None fits: N is padded to the widest segment.
    out_swizzle = narrowest
  out = padded((problem.m, problem.n), out_dtype, out_swizzle, out_tile_n, tile_n)
  return TmaSizes(lhs=lhs, rhs=rhs, out=out)


def zero_pad(x, shape: tuple[int, ...]):
  """`x` with zeros after its end along each dimension up to `shape` (trailing
  dimensions of `x` beyond `shape`'s are kept); `x` itself, not a copy, where
  it has that shape already, and None for None."""
  if x is None or x.shape[-len(shape):] == tuple(shape):
    return x
  lead = x.ndim - len(shape)
  return jnp.pad(x, [(0, 0)] * lead + [(0, want - have) for have, want in
                                       zip(x.shape[lead:], shape, strict=True)])


def pad_operands(lhs, rhs, bias, sizes: TmaSizes):
  """Zero-pads lhs, rhs and bias (N,) to `sizes` (bias to the output's N).

  Copies only the operands whose shape changes.
  """
  return (zero_pad(lhs, sizes.lhs), zero_pad(rhs, sizes.rhs),
          zero_pad(bias, (sizes.out[1],)))


def check_k_tiles(problem: MatmulProblem, tile_k: int) -> int:
  """Number of K steps; K must be a multiple of the config's tile_k."""
  if problem.k % tile_k:
    raise ValueError(f"K={problem.k} must be a multiple of tile_k={tile_k}; pick a config "
                     f"whose tile_k divides K")
  return problem.k // tile_k
