"""Checks on matmul operands, their stored layouts, and the padding TMA needs.

Shared by every matmul wrapper and run before tracing. A matmul computes
`op(lhs) @ op(rhs)` where each operand may be stored transposed
(`OperandLayout`): the LHS as (K, M), the RHS as (N, K). The kernels read
either layout straight from HBM and hand wgmma a transposed SMEM view, so
`x.T @ y` and `x @ y.T` need no transpose copy.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from core.memory import TILE_ROWS
from pipelines.config import check_operand_dtype


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


def check_operands(lhs, rhs, layout: OperandLayout = NN) -> MatmulProblem:
  """Validates `lhs` and `rhs` stored as `layout` says; raises `ValueError` naming the argument.

  Any M, K and N (0 included) are valid: wrappers pad what their kernel needs.
  """
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if x.ndim != 2:
      raise ValueError(f"{name} must be 2-D (use jax.vmap for a batch), got {name}.shape={x.shape}")
  check_operand_dtype("lhs", lhs.dtype)
  check_operand_dtype("rhs", rhs.dtype)
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


def tma_sizes(problem: MatmulProblem, *, k_multiple: int, minor_multiple: int, tile_m: int,
              tile_n: int) -> tuple[int, int, int]:
  """The (M, K, N) the operands are padded to for a kernel's TMA copies.

  TMA reads and writes a GMEM array through the same (8, swizzle) tiling as
  its SMEM tile, so each stored array's minor dimension must be a multiple
  of the swizzle width (`minor_multiple` elements) and its major one of 8
  rows. The partial tiles at the edges are then masked by TMA itself. K is
  rounded up to whole `k_multiple` steps: zeros add nothing to the products.
  A tile wider than the whole of its array's minor dimension is not masked
  correctly, though: on an H200, N = 64 under 128-wide CTA tiles gave wrong
  products whenever K took two steps or more (relative error 0.7-1.0; M
  below the tile, as a major dimension, was right), so a minor M or N is
  padded to at least its tile.
  """
  layout = problem.layout
  k = round_up(problem.k, k_multiple)
  if layout.transpose_lhs:  # M is the minor dimension of the stored LHS.
    m = max(round_up(problem.m, minor_multiple), tile_m)
  else:
    m = round_up(problem.m, TILE_ROWS)
  # N is the output's minor dimension in every layout.
  n = max(round_up(problem.n, minor_multiple), tile_n)
  return m, k, n


def pad_operands(lhs, rhs, bias, problem: MatmulProblem, *, m: int, k: int, n: int):
  """Zero-pads lhs, rhs (stored as `problem.layout` says) and bias (N,) to (m, k, n).

  Copies only the operands whose stored shape changes.
  """
  def pad(x, shape):
    if x is None or x.shape == shape:
      return x
    return jnp.pad(x, [(0, want - have) for have, want in zip(x.shape, shape, strict=True)])

  layout = problem.layout
  return (pad(lhs, layout.lhs_shape(m, k)), pad(rhs, layout.rhs_shape(k, n)),
          pad(bias, (n,)))


def check_k_tiles(problem: MatmulProblem, tile_k: int) -> int:
  """Number of K steps; K must be a multiple of the config's tile_k."""
  if problem.k % tile_k:
    raise ValueError(f"K={problem.k} must be a multiple of tile_k={tile_k}; pick a config "
                     f"whose tile_k divides K")
  return problem.k // tile_k
