"""The warp-specialized persistent matmul for Hopper (sm_90).

One block per SM (grid axis "sm") loops over output tiles in a swizzled order
(`plgpu.planar_snake`), so consecutive tiles of neighbouring blocks share
operand panels in L2. Each block runs three warpgroups (thread axis "wg"):
two compute warpgroups each accumulate a (tile_m, tile_n) float32 tile with
wgmma, and one memory warpgroup (`emit_pipeline_warp_specialized`) keeps
`max_concurrent_steps` SMEM slots of operand tiles in flight with TMA.

The epilogue applies the fused bias/activation in float32, casts, and stores
through double-buffered (epi_tile_m, epi_tile_n) SMEM tiles with TMA, so the
store of one sub-tile overlaps the conversion of the next.

With `config.k_splits` > 1 (split-K, for outputs with too few tiles to
occupy the SMs), the blocks loop over (K range, output tile) pairs and store
float32 partial tiles; `ws_matmul` sums them, with the bias and activation,
in one XLA fusion.

`emit_ws_matmul` is the kernel body as a building block: other kernels (the
collective matmul) call it inside their own `plgpu.kernel` and hook into the
pipeline with `pipeline_callback` and `delay_release`. `ws_matmul` runs
either this cooperative schedule or the ping-pong one
(`pingpong_matmul_sm90`), as `config.schedule` says.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import (
    accumulator,
    barrier,
    compiler_params,
    device_facts,
    interpret_params,
    tile_transforms,
)
from core.memory import swizzle_elems
from pipelines import operands
from pipelines.config import (
    NUM_COMPUTE_WGS,
    MatmulDimension,
    Schedule,
    TuningConfig,
    check_swizzle,
)
from pipelines.epilogue import BIAS_DTYPE, Epilogue, epilogue_scratch, store_epilogue
from pipelines.pingpong_matmul_sm90 import emit_pingpong_matmul

SM_AXIS = "sm"
WG_AXIS = "wg"
# Registers the memory warpgroup keeps; the compute warpgroups get the rest.
MEMORY_WG_REGISTERS = 40

# pipeline_callback(m_tile, n_tile, k_step, lhs_smem, rhs_smem): runs in each
# compute warpgroup after it issued the step's wgmma.
PipelineCallback = Callable[[jax.Array, jax.Array, jax.Array, object, object], None]


def emit_ws_matmul(lhs_gmem, rhs_gmem, out_gmem, bias_gmem=None, *, config: TuningConfig,
                   epilogue: Epilogue = Epilogue(),
                   pipeline_callback: PipelineCallback | None = None,
                   delay_release: int = 0) -> None:
  """Emits `out_gmem = epilogue(lhs_gmem @ rhs_gmem + bias_gmem)` inside a kernel.

  Must be called from a `plgpu.kernel` with grid axis `SM_AXIS` and three
  threads on axis `WG_AXIS`. All shapes are static; M and N may be ragged
  (TMA masks the edge tiles) but M must be a multiple of 8 and N of the
  swizzle width and at least the CTA tile's (`operands.pad_for_tma`); K a
  multiple of `config.tile_k` times `config.k_splits`.

  Args:
    lhs_gmem: (M, K) ref; rhs_gmem: (K, N) ref.
    out_gmem: (M, N) ref; with `config.k_splits` > 1, a (k_splits, M, N)
      float32 ref that receives each K range's partial product (the
      epilogue must then be the identity and `bias_gmem` None: the caller
      applies them to the sum).
    bias_gmem: (N,) float32 ref, or None.
    config: a `TuningConfig` with the cooperative schedule (`ws_matmul` runs
      the ping-pong one, which has no `pipeline_callback`).
    pipeline_callback: see `PipelineCallback`; with it, `delay_release` keeps
      each step's SMEM slots alive that many extra steps, for async reads of
      them the callback started (it must finish them by then).
  """
  if config.schedule != Schedule.COOPERATIVE:
    raise ValueError(f"emit_ws_matmul runs the cooperative schedule; got {config.schedule!r}")
  k_splits = config.k_splits
  if k_splits > 1 and (bias_gmem is not None or epilogue != Epilogue()
                       or pipeline_callback is not None):
    raise ValueError(f"k_splits={k_splits} stores float32 partial sums: the bias, activation "
                     "and pipeline_callback belong to the caller")
  m, k = lhs_gmem.shape
  n = rhs_gmem.shape[1]
  dtype, out_dtype = lhs_gmem.dtype, out_gmem.dtype
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  cta_m, cta_n = config.cta_tile_m, config.cta_tile_n
  m_tiles, n_tiles = pl.cdiv(m, cta_m), pl.cdiv(n, cta_n)
  split_k = k // k_splits  # The K range of one block's share of a tile.
  k_steps = split_k // tile_k

  def make_pipeline(step, compute_context):
    def spec(block_shape, index_map, minor):
      return plgpu.BlockSpec(block_shape, index_map, transforms=tile_transforms(minor, dtype),
                             delay_release=delay_release)
    return plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(k_steps,),
        memory_registers=MEMORY_WG_REGISTERS,
        in_specs=[spec((cta_m, tile_k), lambda kk: (0, kk), tile_k),
                  spec((tile_k, cta_n), lambda kk: (kk, 0), cta_n)],
        wg_axis=WG_AXIS,
        num_compute_wgs=NUM_COMPUTE_WGS,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context,
    )

  def ignore(*_, **__):
    return None

  # The pipeline's SMEM depends only on shapes, so one allocation serves every
  # output tile and no scoped allocation (a block-wide sync) sits in the loop.
  scratch = dict(
      pipeline_allocs=make_pipeline(ignore, ignore).get_allocations(lhs_gmem, rhs_gmem),
      **epilogue_scratch(config, out_dtype, has_bias=bias_gmem is not None),
  )
  if delay_release:
    # The pipeline never waits for the release of a tile's last
    # `delay_release` steps, so the memory warpgroup could refill those slots
    # for the next tile while a wgmma or a callback's copy still reads them.
    # The compute warpgroups arrive here once they are done with every slot.
    scratch["tile_drained"] = barrier(num_arrivals=NUM_COMPUTE_WGS)

  @functools.partial(pl.run_scoped, **scratch, collective_axes=WG_AXIS)
  def _scope(pipeline_allocs, out_smem, tile_drained=None, bias_smem=None, bias_loaded=None):
    wg = lax.axis_index(WG_AXIS)

    # With a split K, the work items are (K range, output tile) pairs; the
    # K range varies slowest, so concurrent blocks share operand panels in L2.
    @plgpu.nd_loop((k_splits * m_tiles * n_tiles,), collective_axes=SM_AXIS)
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      (linear,) = loop_info.index
      split, tile = divmod(linear, m_tiles * n_tiles) if k_splits > 1 else (0, linear)
      m_tile, n_tile = plgpu.planar_snake(tile, (m_tiles, n_tiles), config.grid_minor_dim,
                                          config.grid_tile_width)
      cta_m_slice = pl.ds(m_tile * cta_m, cta_m)
      cta_n_slice = pl.ds(n_tile * cta_n, cta_n)
      k_slice = pl.ds(split * split_k, split_k)
      if config.wg_dimension == MatmulDimension.M:
        wg_m_slice, wg_n_slice = pl.ds(wg * tile_m, tile_m), slice(None)
      else:
        wg_m_slice, wg_n_slice = slice(None), pl.ds(wg * tile_n, tile_n)
      split_out = out_gmem.at[split] if k_splits > 1 else out_gmem
      wg_out = split_out.at[cta_m_slice, cta_n_slice].at[wg_m_slice, wg_n_slice]

      def mma_step(indices, lhs_smem, rhs_smem, acc_ref):
        plgpu.wgmma(acc_ref, lhs_smem.at[wg_m_slice], rhs_smem.at[:, wg_n_slice])
        if pipeline_callback is not None:
          pipeline_callback(m_tile, n_tile, indices[0], lhs_smem, rhs_smem)
        # The pipeline reuses a slot `delay_release` steps after this one, so
        # that many wgmmas may still be reading their slots.
        plgpu.wgmma_wait(delay_release)
        return acc_ref

      def compute_context(run_pipeline):
        if bias_gmem is not None:
          # Start the bias load now; it lands while the K loop runs.
          plgpu.copy_gmem_to_smem(bias_gmem.at[cta_n_slice].at[wg_n_slice],
                                  bias_smem.at[wg], bias_loaded.at[wg])

        @functools.partial(pl.run_scoped, acc_ref=accumulator((tile_m, tile_n)))
        def _acc_scope(acc_ref):
          run_pipeline(acc_ref)
          acc = acc_ref[...]  # Waits for every wgmma of the tile.
          if tile_drained is not None:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # The callback's copies.
            plgpu.barrier_arrive(tile_drained)
          if bias_gmem is not None:
            plgpu.barrier_wait(bias_loaded.at[wg])
          store_epilogue(acc, wg, wg_out, out_smem, bias_smem, config, epilogue)

      make_pipeline(mma_step, compute_context)(
          lhs_gmem.at[cta_m_slice, k_slice], rhs_gmem.at[k_slice, cta_n_slice],
          allocations=pipeline_allocs)
      if tile_drained is not None:
        @pl.when(wg == NUM_COMPUTE_WGS)  # The memory warpgroup.
        def _wait_drained():
          plgpu.barrier_wait(tile_drained)

  # The last tile's stores must be done reading SMEM before the kernel
  # exits (their GMEM writes complete on their own).
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def check_config(config: TuningConfig, problem: operands.MatmulProblem, out_dtype, *,
                 has_bias: bool = False, delay_release: int = 0) -> int:
  """Checks `config` against the problem and the SMEM budget; returns the K steps.

  `problem.k` must be a multiple of `config.tile_k`: `ws_matmul` checks the
  K it pads to (a multiple of tile_k * k_splits), the ring kernel its own.
  """
  k_steps = operands.check_k_tiles(problem, config.tile_k)
  check_swizzle(config, problem.dtype)
  if delay_release and config.schedule != Schedule.COOPERATIVE:
    raise ValueError(f"delay_release={delay_release} (a pipeline_callback's hold on its "
                     f"slots) needs schedule=Schedule.COOPERATIVE, not {config.schedule!r}")
  if delay_release and config.k_splits > 1:
    raise ValueError(f"delay_release={delay_release} (a pipeline_callback's hold on its "
                     f"slots) needs k_splits=1, not {config.k_splits}")
  if not 0 <= delay_release < config.max_concurrent_steps:
    raise ValueError(f"delay_release={delay_release} must be in [0, max_concurrent_steps="
                     f"{config.max_concurrent_steps})")
  config.smem_budget(problem.k, problem.dtype, out_dtype, has_bias=has_bias,
                     delay_release=delay_release).check(what=repr(config))
  return k_steps


def ws_matmul(lhs: jax.Array, rhs: jax.Array, bias: jax.Array | None = None, *,
              config: TuningConfig, epilogue: Epilogue = Epilogue(),
              out_dtype=None) -> jax.Array:
  """`epilogue(lhs @ rhs + bias)` with the warp-specialized kernel and a given config.

  Where M, N or K is 0 no kernel runs: the result is what `jnp.dot` gives
  (an empty array, or for K = 0 the epilogue of zeros). A K that is not a
  multiple of `config.tile_k * config.k_splits` is zero-padded up to one,
  which copies both operands (`operands.pad_k`).

  Args:
    lhs: (M, K) float16 or bfloat16; rhs: (K, N) of the same dtype. K a
      multiple of 16.
    bias: (N,) of any float dtype, or None; added in float32.
    config: tiles, pipeline depth, tile order, schedule and split of K (see
      `TuningConfig`).
    epilogue: activation; `epilogue.has_bias` must match `bias`. Fused into the
      kernel, or with `config.k_splits` > 1 into the XLA sum of the partials.
    out_dtype: float16, bfloat16 or float32; the operand dtype by default.

  Returns:
    (M, N) array of `out_dtype`, accumulated in float32.
  """
  problem = operands.check_operands(lhs, rhs)
  out_dtype = operands.check_out_dtype(out_dtype, problem.dtype)
  if (bias is not None) != epilogue.has_bias:
    raise ValueError(f"bias is {'given' if bias is not None else 'missing'} but "
                     f"epilogue.has_bias={epilogue.has_bias}")
  if bias is not None:
    if bias.shape != (problem.n,):
      raise ValueError(f"bias must have shape (N,)=({problem.n},), got {bias.shape=}")
    bias = bias.astype(BIAS_DTYPE)
  k_multiple = config.tile_k * config.k_splits
  check_config(config, operands.pad_k(problem, k_multiple), out_dtype, has_bias=bias is not None)
  if problem.is_empty:
    return epilogue.apply_to_sum(jnp.zeros((problem.m, problem.n), jnp.float32),
                                 bias).astype(out_dtype)
  lhs, rhs = operands.pad_k_operands(lhs, rhs, k_multiple)
  store_dtype = config.store_dtype(out_dtype)
  n_multiple = math.lcm(swizzle_elems(config.cta_tile_n, problem.dtype),
                        swizzle_elems(config.epi_tile_n, store_dtype))
  lhs, rhs, bias, (m, n) = operands.pad_for_tma(lhs, rhs, bias, n_multiple=n_multiple,
                                                tile_n=config.cta_tile_n)
  padded_m, padded_n = lhs.shape[0], rhs.shape[1]
  kernel_bias, kernel_epilogue = (bias, epilogue) if config.fuses_epilogue else (None, Epilogue())

  def ws_matmul_kernel(lhs_gmem, rhs_gmem, *rest):
    *bias_gmem, out_gmem = rest
    if config.schedule == Schedule.PINGPONG:
      emit_pingpong_matmul(lhs_gmem, rhs_gmem, out_gmem, *bias_gmem, config=config,
                           epilogue=kernel_epilogue, sm_axis=SM_AXIS, wg_axis=WG_AXIS,
                           memory_registers=MEMORY_WG_REGISTERS)
    else:
      emit_ws_matmul(lhs_gmem, rhs_gmem, out_gmem, *bias_gmem, config=config,
                     epilogue=kernel_epilogue)

  splits = (config.k_splits,) if config.k_splits > 1 else ()
  num_tiles = pl.cdiv(padded_m, config.cta_tile_m) * pl.cdiv(padded_n, config.cta_tile_n)
  kernel = plgpu.kernel(
      ws_matmul_kernel,
      out_type=jax.ShapeDtypeStruct((*splits, padded_m, padded_n), store_dtype),
      grid=(min(device_facts().sm_count, num_tiles * config.k_splits),),
      grid_names=(SM_AXIS,),
      num_threads=NUM_COMPUTE_WGS + 1,
      thread_name=WG_AXIS,
      compiler_params=compiler_params(),
      interpret=interpret_params(),
  )
  out = kernel(lhs, rhs, *(() if kernel_bias is None else (kernel_bias,)))
  if not config.fuses_epilogue:
    # One XLA fusion reads the partials once: sum, bias, activation, cast.
    return epilogue.apply_to_sum(out[:, :m, :n].sum(axis=0),
                                 None if bias is None else bias[:n]).astype(out_dtype)
  return out if out.shape == (m, n) else out[:m, :n]
