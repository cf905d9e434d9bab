"""Checks on matmul operands, shared by every matmul wrapper, run before tracing."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from core.memory import TILE_ROWS
from core.memory import TMA_MIN_BYTES as TMA_ROW_BYTES
from pipelines.config import K_MULTIPLE, check_operand_dtype


@dataclasses.dataclass(frozen=True)
class MatmulProblem:
  """out[m, n] = sum_k lhs[m, k] * rhs[k, n], with 16-bit operands."""

  m: int
  k: int
  n: int
  dtype: jnp.dtype

  @property
  def flops(self) -> int:
    return 2 * self.m * self.k * self.n

  @property
  def is_empty(self) -> bool:
    """Whether M, N or K is 0: the product is all zeros (or has no elements)."""
    return not (self.m and self.k and self.n)


def check_operands(lhs, rhs) -> MatmulProblem:
  """Validates `lhs` (M, K) and `rhs` (K, N); raises `ValueError` naming the argument."""
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if x.ndim != 2:
      raise ValueError(f"{name} must be 2-D (use jax.vmap for a batch), got {name}.shape={x.shape}")
  check_operand_dtype("lhs", lhs.dtype)
  check_operand_dtype("rhs", rhs.dtype)
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"lhs and rhs dtypes differ: {lhs.dtype=}, {rhs.dtype=}")
  (m, k), (k2, n) = lhs.shape, rhs.shape
  if k != k2:
    raise ValueError(f"K of lhs and rhs differ: {lhs.shape=}, {rhs.shape=}")
  if k % K_MULTIPLE:
    raise ValueError(f"K={k} must be a multiple of {K_MULTIPLE} (the wgmma K step); "
                     f"{lhs.shape=}, {rhs.shape=}")
  if (n * lhs.dtype.itemsize) % TMA_ROW_BYTES:
    raise ValueError(f"N={n} must be a multiple of {TMA_ROW_BYTES // lhs.dtype.itemsize}: TMA "
                     f"needs rows of rhs and out that are multiples of {TMA_ROW_BYTES} bytes; "
                     f"{rhs.shape=}")
  return MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(lhs.dtype))


def check_out_dtype(out_dtype, default) -> jnp.dtype:
  out_dtype = jnp.dtype(default if out_dtype is None else out_dtype)
  if out_dtype not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise ValueError(f"out_dtype={out_dtype.name} must be float16, bfloat16 or float32")
  return out_dtype


def pad_for_tma(lhs, rhs, bias, *, n_multiple: int, tile_n: int):
  """Pads M to a multiple of 8 rows and N to `n_multiple` columns, and at
  least `tile_n`, with zeros.

  TMA reads and writes a GMEM array through the same (8, swizzle) tiling as
  its SMEM tile, so the GMEM dimensions must be multiples of that tiling. The
  partial tiles at the edges are then masked by TMA itself; only arrays whose
  M or N is off the tiling are copied. A tile wider than the whole of N is
  not masked correctly, though: on an H200, N = 64 under 128-wide CTA tiles
  gave wrong products whenever K took two steps or more (relative error
  0.7-1.0; M below the CTA tile was right), so such an N is padded to
  `tile_n`. Returns (lhs, rhs, bias, (M, N)).
  """
  (m, _), n = lhs.shape, rhs.shape[1]
  m_pad = -m % TILE_ROWS
  n_pad = max(-n % n_multiple, tile_n - n)
  if m_pad:
    lhs = jnp.pad(lhs, ((0, m_pad), (0, 0)))
  if n_pad:
    rhs = jnp.pad(rhs, ((0, 0), (0, n_pad)))
    if bias is not None:
      bias = jnp.pad(bias, (0, n_pad))
  return lhs, rhs, bias, (m, n)


def pad_k(problem: MatmulProblem, k_multiple: int) -> MatmulProblem:
  """`problem` with K rounded up to a multiple of `k_multiple` (see `pad_k_operands`)."""
  return dataclasses.replace(problem, k=-(-problem.k // k_multiple) * k_multiple)


def pad_k_operands(lhs, rhs, k_multiple: int):
  """Zero-pads K of lhs (M, K) and rhs (K, N) up to a multiple of `k_multiple`.

  The kernels step through K in whole `tile_k` steps, and the widest swizzle
  needs 64-element K tiles of 16-bit operands, so a K such as 80 is padded
  to 128. Zeros add nothing to the products. Copies both operands, only when
  K is off the multiple.
  """
  k_pad = -lhs.shape[1] % k_multiple
  if not k_pad:
    return lhs, rhs
  return jnp.pad(lhs, ((0, 0), (0, k_pad))), jnp.pad(rhs, ((0, k_pad), (0, 0)))


def check_k_tiles(problem: MatmulProblem, tile_k: int) -> int:
  """Number of K steps; K must be a multiple of the config's tile_k."""
  if problem.k % tile_k:
    raise ValueError(f"K={problem.k} must be a multiple of tile_k={tile_k}; pick a config "
                     f"whose tile_k divides K")
  return problem.k // tile_k
