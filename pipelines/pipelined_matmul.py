"""The `emit_pipeline` matmul: a parallel grid of output tiles, a pipelined K loop.

Each block is one warpgroup that owns a (tile_m, tile_n) float32 accumulator
in registers. `plgpu.emit_pipeline` streams (tile_m, tile_k) and (tile_k,
tile_n) operand tiles into `max_concurrent_steps` SMEM slots with TMA; each step
issues a wgmma and leaves `delay_release` of them in flight. The result is
cast, staged in SMEM and stored with one TMA copy.

M and N need not be multiples of the tile: TMA zero-fills the out-of-bounds
part of a loaded tile and clips the out-of-bounds part of a stored one, so edge
tiles are masked by the hardware. Only M off a multiple of 8 or N off the
swizzle width (64 elements for 16-bit) is padded, because TMA's GMEM tiling
needs those multiples.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import accumulator, compiler_params, interpret_params, smem, tile_transforms
from core.memory import swizzle_elems
from pipelines import operands
from pipelines.config import PipelinedConfig, check_swizzle


def _pipelined_matmul_kernel(lhs_gmem, rhs_gmem, out_gmem, *, config: PipelinedConfig,
                             k_steps: int):
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  m_slice = pl.ds(lax.axis_index("m") * tile_m, tile_m)
  n_slice = pl.ds(lax.axis_index("n") * tile_n, tile_n)
  dtype = lhs_gmem.dtype

  def accumulate(acc_ref):
    def step(_, lhs_smem, rhs_smem):
      plgpu.wgmma(acc_ref, lhs_smem, rhs_smem)
      # Keeping `delay_release` wgmmas in flight is safe because the pipeline
      # holds their SMEM slots for that many extra steps before refilling.
      plgpu.wgmma_wait(config.delay_release)

    plgpu.emit_pipeline(
        step,
        grid=(k_steps,),
        in_specs=[
            config.pipeline.block_spec((tile_m, tile_k), lambda k: (0, k),
                                       transforms=tile_transforms(tile_k, dtype)),
            config.pipeline.block_spec((tile_k, tile_n), lambda k: (k, 0),
                                       transforms=tile_transforms(tile_n, dtype)),
        ],
        max_concurrent_steps=config.max_concurrent_steps,
    )(lhs_gmem.at[m_slice, :], rhs_gmem.at[:, n_slice])
    return acc_ref[...]  # Reading the accumulator waits for all wgmmas.

  acc = pl.run_scoped(accumulate, accumulator((tile_m, tile_n)))

  def store(out_smem):
    out_smem[...] = acc.astype(out_smem.dtype)
    plgpu.commit_smem()  # Register stores must be visible to the TMA engine.
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[m_slice, n_slice])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(store, smem((tile_m, tile_n), out_gmem.dtype, swizzled=True))


def pipelined_matmul(lhs: jax.Array, rhs: jax.Array, *,
                     config: PipelinedConfig = PipelinedConfig(),
                     out_dtype=None) -> jax.Array:
  """`lhs @ rhs` with the emit_pipeline + wgmma kernel.

  Args:
    lhs: (M, K) float16 or bfloat16.
    rhs: (K, N), same dtype. K must be a multiple of `config.tile_k`.
    config: tiles and pipeline depth.
    out_dtype: float16, bfloat16 or float32; defaults to the operand dtype.

  Returns:
    (M, N) array of `out_dtype`, accumulated in float32; zeros without a
    kernel where K is 0.
  """
  problem = operands.check_operands(lhs, rhs)
  out_dtype = operands.check_out_dtype(out_dtype, problem.dtype)
  k_steps = operands.check_k_tiles(problem, config.tile_k)
  check_swizzle(config, problem.dtype)
  if problem.is_empty:
    return jnp.zeros((problem.m, problem.n), out_dtype)  # As jnp.dot, with no kernel.
  config.smem_budget(problem.k, problem.dtype, out_dtype).check(what=repr(config))
  n_multiple = math.lcm(swizzle_elems(config.tile_n, problem.dtype),
                        swizzle_elems(config.tile_n, out_dtype))
  lhs, rhs, _, (m, n) = operands.pad_for_tma(lhs, rhs, None, n_multiple=n_multiple,
                                             tile_n=config.tile_n)
  padded_m, padded_n = lhs.shape[0], rhs.shape[1]
  kernel = plgpu.kernel(
      functools.partial(_pipelined_matmul_kernel, config=config, k_steps=k_steps),
      out_type=jax.ShapeDtypeStruct((padded_m, padded_n), out_dtype),
      grid=(pl.cdiv(padded_m, config.tile_m), pl.cdiv(padded_n, config.tile_n)),
      grid_names=("m", "n"),
      compiler_params=compiler_params(),
      interpret=interpret_params(),
  )
  out = kernel(lhs, rhs)
  return out if out.shape == (m, n) else out[:m, :n]


