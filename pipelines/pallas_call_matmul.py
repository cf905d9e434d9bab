"""The pipelined matmul through the `pl.pallas_call` compatibility API.

The same computation as `pipelined_matmul`, written as a `pl.pallas_call`
whose grid is (M tiles, N tiles, K steps) with
`dimension_semantics=("parallel", "parallel", "sequential")`: Mosaic GPU turns
the parallel dimensions into the CUDA grid and pipelines the sequential one
with `max_concurrent_steps` SMEM slots (`delay_release` sits on each
`plgpu.BlockSpec` in jax 0.11.2). Without a sequential dimension, nothing is
pipelined: every grid point is its own block and loads its whole K range once
(the `all_parallel` variant below, used by the tests to show the difference).

In jax 0.11.2 the public `pl.pallas_call` has no Mosaic GPU lowering
registered for `plgpu.CompilerParams` (it fails with an AssertionError in
`pallas_call.gpu_lowering`, on CPU and GPU alike), so on a GPU this goes
through Mosaic GPU's own compatibility entry point,
`jax._src.pallas.mosaic_gpu.pallas_call`, which builds the same `plgpu.kernel`
+ `emit_pipeline` structure. In interpret mode (`core.is_interpreting()`) the
same kernel body, grid and BlockSpecs run in Pallas' generic interpreter
(`pl.pallas_call(..., interpret=True)`) instead; see `_lowering`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import (
  accumulator,
  compiler_params,
  is_interpreting,
  jax_private,
  sequential_grid_semantics,
  smem,
  tile_transforms,
)
from core.varying import varying_axes, varying_kernel
from pipelines import operands
from pipelines.config import PipelinedConfig, check_swizzle
from pipelines.kernel_call import empty_result


def _accumulating_kernel(lhs_smem, rhs_smem, out_smem, acc_smem, *, accumulate: Callable):
  # The compatibility API calls the body once per K step, so the float32
  # partial sum lives in SMEM between steps (a register accumulator cannot be
  # kernel-level scratch here); `accumulate` adds one step's product to it.
  k = pl.program_id(2)

  @pl.when(k == 0)
  def _zero():
    acc_smem[...] = jnp.zeros(acc_smem.shape, jnp.float32)

  accumulate(acc_smem, lhs_smem, rhs_smem)

  @pl.when(k == pl.num_programs(2) - 1)
  def _store():
    out_smem[...] = acc_smem[...].astype(out_smem.dtype)


def _wgmma_accumulate(acc_smem, lhs_smem, rhs_smem, *, delay_release: int):
  """acc_smem += lhs_smem @ rhs_smem through a wgmma accumulator in registers."""
  def step(acc_ref):
    acc_ref[...] = acc_smem[...]
    plgpu.wgmma(acc_ref, lhs_smem, rhs_smem)
    plgpu.wgmma_wait(delay_release)  # The BlockSpecs hold each slot that long.
    return acc_ref[...]

  acc_smem[...] = pl.run_scoped(step, accumulator(acc_smem.shape))


def _dot_accumulate(acc_smem, lhs_smem, rhs_smem):
  """acc_smem += lhs_smem @ rhs_smem with a float32 `jnp.dot` (runs on any backend)."""
  acc_smem[...] += jnp.dot(lhs_smem[...], rhs_smem[...], preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Lowering:
  """What differs between compiling the kernel and interpreting it.

  Attributes:
    accumulate: the body's K step, `accumulate(acc_smem, lhs_smem, rhs_smem)`.
    tiled_smem: whether the BlockSpecs carry the tiling and swizzle transforms
      TMA and wgmma need.
    pallas_call: `pallas_call(kernel, out_shape, *, grid, in_specs,
      out_specs, scratch_shapes, compiler_params)`.
  """

  accumulate: Callable
  tiled_smem: bool
  pallas_call: Callable


def _lowering(delay_release: int) -> _Lowering:
  """The one place that chooses how the kernel below runs here."""
  if is_interpreting():
    # jax 0.11.2's Mosaic GPU interpreter cannot store into a wgmma
    # accumulator ("Accumulator shape (6,) does not match value shape"),
    # which this body needs between K steps. Pallas' generic interpreter runs
    # the grid as a sequential loop on CPU, keeping the SMEM scratch between
    # grid points, but knows neither wgmma nor the swizzled SMEM layout (no
    # discharge rule for `UnswizzleRef`): it gets a plain float32 dot into
    # the same SMEM accumulator and untransformed blocks. It ignores
    # `compiler_params`, which still records the pipelining a GPU would get.
    return _Lowering(accumulate=_dot_accumulate, tiled_smem=False,
                     pallas_call=functools.partial(pl.pallas_call, interpret=True))
  return _Lowering(accumulate=functools.partial(_wgmma_accumulate, delay_release=delay_release),
                   tiled_smem=True, pallas_call=jax_private.mosaic_gpu_pallas_call)


# The compatibility API gives the output block as many SMEM slots as the
# inputs and keeps the float32 partial sum in SMEM
# (`PipelinedConfig.pallas_call_smem_budget`), so the emit_pipeline kernel's
# default depth of 4 does not fit at 128x128 tiles; 2 does.
DEFAULT_CONFIG = PipelinedConfig(max_concurrent_steps=2)


def pallas_call_matmul(lhs: jax.Array, rhs: jax.Array, *,
                       config: PipelinedConfig = DEFAULT_CONFIG,
                       out_dtype=None, all_parallel: bool = False) -> jax.Array:
  """`lhs @ rhs` via `pl.pallas_call` with a pipelined sequential K dimension.

  Compiled with Mosaic GPU on a GPU; run by Pallas' generic interpreter in
  interpret mode (CPU), from the same kernel body, grid and BlockSpecs.

  Args:
    lhs: (M, K) float16/bfloat16; rhs: (K, N), same dtype. M, N multiples of
      the tile; K a multiple of tile_k.
    config: tiles and pipeline depth, as for `pipelined_matmul`; checked
      against this path's own SMEM model (`pallas_call_smem_budget`) before
      compiling.
    out_dtype: float16, bfloat16 or float32; the operand dtype by default.
    all_parallel: make every grid dimension "parallel" (one K step of the full
      K per block): the documented no-pipelining behaviour.

  Returns:
    (M, N) array of `out_dtype`.
  """
  problem = operands.check_operands(lhs, rhs)
  out_dtype = operands.check_out_dtype(out_dtype, problem.dtype)
  tile_m, tile_n = config.tile_m, config.tile_n
  # All parallel, one K step is the whole K (none where K = 0).
  tile_k = problem.k if all_parallel and problem.k else config.tile_k
  if problem.m % tile_m or problem.n % tile_n:
    raise ValueError(f"M={problem.m} and N={problem.n} must be multiples of "
                     f"tile_m={tile_m} and tile_n={tile_n} on the pallas_call path")
  k_steps = operands.check_k_tiles(problem, tile_k)
  if problem.is_empty:
    return empty_result(problem, out_dtype, (lhs, rhs))
  config = dataclasses.replace(config, tile_k=tile_k)
  # Checked in interpret mode too, so that CPU runs refuse what a GPU would.
  check_swizzle(config, problem.dtype)
  config.pallas_call_smem_budget(problem.k, problem.dtype, out_dtype).check(
      what=f"{config!r} on the pallas_call path")
  steps = config.pipeline.steps_for(k_steps)
  semantics = ("parallel",) * 3 if all_parallel else sequential_grid_semantics(2)
  delay = config.delay_release if steps > config.delay_release else 0
  lowering = _lowering(delay)

  def spec(shape, index_map, minor, dtype, delay_release=0):
    transforms = tile_transforms(minor, dtype) if lowering.tiled_smem else ()
    return plgpu.BlockSpec(shape, index_map, transforms=transforms,
                           delay_release=delay_release)

  # `pl.pallas_call` takes the result's mesh-axis type (see `core.varying`)
  # and insists on one inside a type-checked shard_map in interpret mode; the
  # Mosaic GPU path drops it, as `plgpu.kernel` does, hence `varying_kernel`.
  varying = jax.sharding.ManualAxisType(varying=varying_axes((lhs, rhs)))
  return varying_kernel(lowering.pallas_call(
      functools.partial(_accumulating_kernel, accumulate=lowering.accumulate),
      out_shape=jax.ShapeDtypeStruct((problem.m, problem.n), out_dtype, manual_axis_type=varying),
      grid=(problem.m // tile_m, problem.n // tile_n, k_steps),
      in_specs=[spec((tile_m, tile_k), lambda i, j, k: (i, k), tile_k, problem.dtype, delay),
                spec((tile_k, tile_n), lambda i, j, k: (k, j), tile_n, problem.dtype, delay)],
      out_specs=spec((tile_m, tile_n), lambda i, j, k: (i, j), tile_n, out_dtype),
      scratch_shapes=[smem((tile_m, tile_n), jnp.float32)],
      compiler_params=compiler_params(dimension_semantics=semantics, max_concurrent_steps=steps),
  ))(lhs, rhs)
