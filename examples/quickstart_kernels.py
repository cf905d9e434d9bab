"""The Mosaic GPU quickstart kernels, as library functions.

The smallest kernels of the repository, run by `examples/quickstart.py`.
`fill` writes a constant through SMEM and a TMA copy (a one-block kernel);
`iota` is gridded: block `i` (named axis "block") writes its slice
`[i * block, (i + 1) * block)` straight from registers to GMEM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import compiler, interpret, memory, smem_budget

# One warpgroup stores 128 lanes at a time; blocks are multiples of it.
_LANES = 128
_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32)


def _check_dtype(dtype) -> jnp.dtype:
  dtype = jnp.dtype(dtype)
  if dtype not in [jnp.dtype(d) for d in _DTYPES]:
    raise ValueError(f"dtype={dtype.name} is not supported; use one of "
                     f"{[jnp.dtype(d).name for d in _DTYPES]}")
  return dtype


def fill(shape: tuple[int, ...], value: float, dtype=jnp.float32) -> jax.Array:
  """An array of `shape` and `dtype` filled with `value`.

  The whole array is staged in SMEM, so it must fit there (checked first).
  The minor dimension must be a multiple of 16 bytes (TMA's unit).
  """
  dtype = _check_dtype(dtype)
  shape = tuple(shape)
  if not shape or any(d <= 0 for d in shape):
    raise ValueError(f"shape must be non-empty with positive dims, got {shape}")
  if (shape[-1] * dtype.itemsize) % memory.TMA_MIN_BYTES:
    raise ValueError(f"shape[-1]={shape[-1]} x {dtype.name} must be a multiple of "
                     f"{memory.TMA_MIN_BYTES} bytes for a TMA copy")
  smem_budget.SmemBudget(
      phases=((smem_budget.SmemBuffer(name="out_smem", shape=shape, dtype=dtype),),)
  ).check(what=f"fill(shape={shape}, dtype={dtype.name})")

  def fill_kernel(out_gmem, out_smem):
    out_smem[...] = jnp.full(shape, value, dtype)
    plgpu.commit_smem()  # Make the register stores visible to the TMA engine.
    plgpu.copy_smem_to_gmem(out_smem, out_gmem)
    plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
      fill_kernel,
      out_type=jax.ShapeDtypeStruct(shape, dtype),
      scratch_types=[memory.smem(shape, dtype)],
      compiler_params=compiler.compiler_params(),
      interpret=interpret.interpret_params(),
  )
  return kernel()


def iota(length: int, *, block: int = 256, dtype=jnp.int32) -> jax.Array:
  """`[0, 1, ..., length - 1]`, one grid block per `block` elements.

  Raises `ValueError` unless `block` is a positive multiple of 128 and
  `length` a positive multiple of `block`.
  """
  dtype = _check_dtype(dtype)
  if block <= 0 or block % _LANES:
    raise ValueError(f"block={block} must be a positive multiple of {_LANES}")
  if length <= 0 or length % block:
    raise ValueError(f"length={length} must be a positive multiple of block={block}")

  def iota_kernel(out_gmem):
    i = lax.axis_index("block")
    values = i * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
    out_gmem[pl.ds(i * block, block)] = values.astype(dtype)

  kernel = plgpu.kernel(
      iota_kernel,
      out_type=jax.ShapeDtypeStruct((length,), dtype),
      grid=(length // block,),
      grid_names=("block",),
      compiler_params=compiler.compiler_params(),
      interpret=interpret.interpret_params(),
  )
  return kernel()
