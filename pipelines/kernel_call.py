"""The one wrapper of the matmul kernel bodies: checks, padding, the kernel call, split-K sums.

Every public entry of a kernel (`ws_matmul`, `pipelined_matmul`) runs the
same steps, in order, before anything is traced into a kernel:
  1. check the operands, the output dtype and the bias (`operands`);
  2. check the config against the problem and the SMEM budget, which is
     summed from the scratch declaration the kernel body itself allocates
     (`ws_smem_budget`);
  3. answer empty problems without a kernel, as `jnp.dot` does;
  4. pad K to whole K steps and M and N to what TMA needs (`operands`);
  5. build and call the kernel (`persistent_kernel` for the warp-specialized
     bodies, also used by the ring all-gather matmul);
  6. sum split-K partials with the bias and activation, and slice the
     padding off.
The kernel bodies live in `*_sm90.py`, one per schedule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import SmemBudget, compiler_params, device_facts, interpret_params
from core.memory import swizzle_bytes
from core.varying import vary_over, varying_axes, varying_kernel
from pipelines import operands
from pipelines.config import (
  NUM_COMPUTE_WGS,
  PipelinedConfig,
  Schedule,
  TuningConfig,
  check_swizzle,
  operand_tile_minor_dims,
)
from pipelines.cooperative_matmul_sm90 import (
  cooperative_scratch,
  emit_cooperative_matmul,
  pipeline_buffer_names,
)
from pipelines.epilogue import BIAS_DTYPE, Epilogue
from pipelines.persistent_sm90 import CLUSTER_AXIS, SM_AXIS, WG_AXIS, num_work_items
from pipelines.pingpong_matmul_sm90 import emit_pingpong_matmul, pingpong_scratch
from pipelines.pipelined_matmul_sm90 import M_AXIS, N_AXIS, emit_pipelined_matmul


def ws_smem_budget(config: TuningConfig, problem: operands.MatmulProblem, out_dtype, *,
                   has_bias: bool = False, delay_release: int = 0) -> SmemBudget:
  """The SMEM the warp-specialized kernel of `config.schedule` allocates for `problem`."""
  if config.schedule == Schedule.PINGPONG:
    scratch = pingpong_scratch(config, problem.dtype, out_dtype, k=problem.k, has_bias=has_bias,
                               layout=problem.layout)
  else:
    scratch = cooperative_scratch(config, problem.dtype, out_dtype, k=problem.k,
                                  has_bias=has_bias, delay_release=delay_release,
                                  layout=problem.layout)
  return SmemBudget.of_scratch(scratch, labels={"pipeline_allocs": pipeline_buffer_names(config)})


def check_ws_config(config: TuningConfig, problem: operands.MatmulProblem, out_dtype, *,
                    has_bias: bool = False, delay_release: int = 0,
                    kernel: str | None = None) -> None:
  """Raises `ValueError` unless the warp-specialized kernel can run `config` on `problem`.

  `problem.k` must be a multiple of `config.tile_k`: `ws_matmul` checks the K
  it pads to (a multiple of tile_k * k_splits), the ring kernel its own.
  `delay_release` is a `pipeline_callback`'s hold on its slots
  (`emit_cooperative_matmul`). `kernel` names a kernel that calls
  `emit_cooperative_matmul` in blocks without clusters (the rings), which
  cannot run `config.cluster_m` = 2; None for `ws_matmul`, which can.
  """
  if kernel is not None and config.cluster_m != 1:
    raise ValueError(f"cluster_m={config.cluster_m}: {kernel} runs blocks without clusters; "
                     "use cluster_m=1")
  operands.check_k_tiles(problem, config.tile_k)
  check_swizzle(config, problem.dtype, transpose_lhs=problem.layout.transpose_lhs,
                transpose_rhs=problem.layout.transpose_rhs)
  if delay_release and config.schedule != Schedule.COOPERATIVE:
    raise ValueError(f"delay_release={delay_release} (a pipeline_callback's hold on its "
                     f"slots) needs schedule=Schedule.COOPERATIVE, not {config.schedule!r}")
  if delay_release and config.k_splits > 1:
    raise ValueError(f"delay_release={delay_release} (a pipeline_callback's hold on its "
                     f"slots) needs k_splits=1, not {config.k_splits}")
  if not 0 <= delay_release < config.max_concurrent_steps:
    raise ValueError(f"delay_release={delay_release} must be in [0, max_concurrent_steps="
                     f"{config.max_concurrent_steps})")
  if problem.k:  # K = 0 runs no kernel (`empty_result`), so it allocates nothing.
    ws_smem_budget(config, problem, out_dtype, has_bias=has_bias,
                   delay_release=delay_release).check(what=repr(config))


def ws_tma_sizes(config: TuningConfig, problem: operands.MatmulProblem,
                 out_dtype) -> operands.TmaSizes:
  """The shapes `ws_matmul` pads the operands and its output to for `config`
  (`operands.tma_sizes`)."""
  # The K ranges of a split must be whole K steps; one range may end in a
  # partial step, which TMA fills with zeros.
  k_multiple = config.tile_k * config.k_splits if config.k_splits > 1 else 1
  return operands.tma_sizes(problem, out_dtype=config.store_dtype(out_dtype),
                            k_multiple=k_multiple, tile_m=config.cta_tile_m,
                            tile_n=config.cta_tile_n,
                            copy_tiles=operand_tile_minor_dims(
                                config, transpose_lhs=problem.layout.transpose_lhs,
                                transpose_rhs=problem.layout.transpose_rhs),
                            out_tile_n=config.epi_tile_n,
                            rhs_multicast=config.cluster_m > 1)


def persistent_kernel(body, *, out_type, num_blocks: int, name: str, collective_axes=(),
                      cluster_size: int = 1):
  """`plgpu.kernel` for a warp-specialized body: `num_blocks` persistent blocks on
  `SM_AXIS`, two compute warpgroups and a memory warpgroup on `WG_AXIS`.

  With `cluster_size` > 1, `SM_AXIS` counts clusters of that many blocks
  (`CLUSTER_AXIS`): num_blocks // cluster_size of them.
  Inside `jax.shard_map` its results vary over the mesh axes its arguments
  vary over, and over `collective_axes` (see `core.varying`).
  """
  cluster = dict(cluster=(cluster_size,), cluster_names=(CLUSTER_AXIS,)) if cluster_size > 1 else {}
  return varying_kernel(plgpu.kernel(
      body,
      out_type=out_type,
      grid=(num_blocks // cluster_size,),
      grid_names=(SM_AXIS,),
      **cluster,
      num_threads=NUM_COMPUTE_WGS + 1,
      thread_name=WG_AXIS,
      compiler_params=compiler_params(),
      interpret=interpret_params(),
      kernel_name=name,
  ), collective_axes=collective_axes)


def _check_call(lhs, rhs, bias, out_dtype, layout: operands.OperandLayout = operands.NN):
  """Step 1: (problem, out dtype, bias as float32 or None)."""
  problem = operands.check_operands(lhs, rhs, layout)
  out_dtype = operands.check_out_dtype(out_dtype, problem.dtype)
  if bias is not None:
    if bias.shape != (problem.n,):
      raise ValueError(f"bias must have shape (N,)=({problem.n},), got {bias.shape=}")
    bias = bias.astype(BIAS_DTYPE)
  return problem, out_dtype, bias


def empty_result(problem: operands.MatmulProblem, out_dtype, operands_in: tuple, bias=None,
                 epilogue: Epilogue = Epilogue()) -> jax.Array:
  """Step 3: `jnp.dot`'s answer where M, N or K is 0, with no kernel (the
  epilogue of zeros, which has no elements unless only K is 0), typed as
  varying like the kernel's result would be (`operands_in`: its arguments)."""
  zeros = vary_over(jnp.zeros((problem.m, problem.n), jnp.float32), varying_axes(operands_in))
  return epilogue.apply_to_sum(zeros, bias).astype(out_dtype)


def ws_matmul(lhs: jax.Array, rhs: jax.Array, bias: jax.Array | None = None, *,
              config: TuningConfig, epilogue: Epilogue = Epilogue(),
              out_dtype=None, layout: operands.OperandLayout = operands.NN) -> jax.Array:
  """`epilogue(op(lhs) @ op(rhs) + bias)` with the warp-specialized kernel and a given config.

  Where M, N or K is 0 no kernel runs: the result is what `jnp.dot` gives
  (an empty array, or for K = 0 the epilogue of zeros). Dimensions off what
  TMA needs are zero-padded (`operands.tma_sizes`), which copies the
  operand: a major dimension to a multiple of 8; a minor one off 128 bytes
  to a multiple of 128 bytes, unless the kernel reading it in place with a
  narrower swizzle is modelled faster (never where it is off 32 bytes); with
  `config.k_splits` > 1, K to a multiple of `config.tile_k * config.k_splits`.
  Arrays whose tiles are one swizzle segment wide (the (M, K) LHS under
  64-element float16 K steps, a (K, N) RHS under 64-column warpgroup tiles,
  a 16-bit output under 64-column epilogue tiles) are copied as 2D boxes,
  which need no padding unless their rows are off 16 bytes (or, for that
  RHS, off 32 bytes with M over 256). TMA fills a partial last K step with zeros.

  Args:
    lhs: (M, K) float16 or bfloat16, or (K, M) with `layout.transpose_lhs`.
    rhs: (K, N) of the same dtype, or (N, K) with `layout.transpose_rhs`.
    bias: (N,) of any float dtype, or None; added in float32.
    config: tiles, pipeline depth, tile order, schedule and split of K (see
      `TuningConfig`).
    epilogue: activation; `epilogue.has_bias` must match `bias`. Fused into the
      kernel, or with `config.k_splits` > 1 into the XLA sum of the partials.
    out_dtype: float16, bfloat16 or float32; the operand dtype by default.
    layout: how lhs and rhs are stored (`operands.OperandLayout`).

  Returns:
    (M, N) array of `out_dtype`, accumulated in float32.
  """
  if (bias is not None) != epilogue.has_bias:
    raise ValueError(f"bias is {'given' if bias is not None else 'missing'} but "
                     f"epilogue.has_bias={epilogue.has_bias}")
  problem, out_dtype, bias = _check_call(lhs, rhs, bias, out_dtype, layout)
  check_ws_config(config, operands.pad_k(problem, config.tile_k * config.k_splits), out_dtype,
                  has_bias=bias is not None)
  if problem.is_empty:
    return empty_result(problem, out_dtype, (lhs, rhs), bias, epilogue)
  store_dtype = config.store_dtype(out_dtype)
  sizes = ws_tma_sizes(config, problem, out_dtype)
  lhs, rhs, bias = operands.pad_operands(lhs, rhs, bias, sizes)
  padded_m, padded_n = sizes.out
  m, n = problem.m, problem.n
  kernel_bias, kernel_epilogue = (bias, epilogue) if config.fuses_epilogue else (None, Epilogue())
  emit = (emit_pingpong_matmul if config.schedule == Schedule.PINGPONG
          else emit_cooperative_matmul)

  def body(lhs_gmem, rhs_gmem, *rest):
    *bias_gmem, out_gmem = rest
    emit(lhs_gmem, rhs_gmem, out_gmem, *bias_gmem, config=config, epilogue=kernel_epilogue,
         layout=layout)

  splits = (config.k_splits,) if config.k_splits > 1 else ()
  work_items = num_work_items(config, pl.cdiv(padded_m, config.cta_tile_m),
                              pl.cdiv(padded_n, config.cta_tile_n))
  clusters = min(device_facts().sm_count // config.cluster_m, work_items)
  kernel = persistent_kernel(
      body, out_type=jax.ShapeDtypeStruct((*splits, padded_m, padded_n), store_dtype),
      num_blocks=clusters * config.cluster_m, cluster_size=config.cluster_m,
      name=f"ws_matmul_{config.schedule.value}_{layout.name}")
  out = kernel(lhs, rhs, *(() if kernel_bias is None else (kernel_bias,)))
  if not config.fuses_epilogue:
    # One XLA fusion reads the partials once: sum, bias, activation, cast.
    return epilogue.apply_to_sum(out[:, :m, :n].sum(axis=0),
                                 None if bias is None else bias[:n]).astype(out_dtype)
  return out if out.shape == (m, n) else out[:m, :n]


def pipelined_matmul(lhs: jax.Array, rhs: jax.Array, *,
                     config: PipelinedConfig = PipelinedConfig(),
                     out_dtype=None) -> jax.Array:
  """`lhs @ rhs` with the emit_pipeline + wgmma kernel (`pipelined_matmul_sm90`).

  Args:
    lhs: (M, K) float16 or bfloat16.
    rhs: (K, N), same dtype. K must be a multiple of `config.tile_k`.
    config: tiles and pipeline depth.
    out_dtype: float16, bfloat16 or float32; defaults to the operand dtype.

  Returns:
    (M, N) array of `out_dtype`, accumulated in float32; zeros without a
    kernel where K is 0.
  """
  problem, out_dtype, _ = _check_call(lhs, rhs, None, out_dtype)
  operands.check_k_tiles(problem, config.tile_k)
  check_swizzle(config, problem.dtype)
  if problem.is_empty:
    return empty_result(problem, out_dtype, (lhs, rhs))
  # emit_pipeline allocates its slots itself, so this budget is a model
  # (tested against Mosaic GPU's own allocation in smem_budget_test).
  config.smem_budget(problem.k, problem.dtype, out_dtype).check(what=repr(config))
  # emit_pipeline's tiles take the widest swizzle their rows allow.
  swizzle = min(swizzle_bytes(config.tile_k, problem.dtype),
                swizzle_bytes(config.tile_n, problem.dtype),
                swizzle_bytes(config.tile_n, out_dtype))
  sizes = operands.tma_sizes(problem, out_dtype=out_dtype, k_multiple=config.tile_k,
                             tile_m=config.tile_m, tile_n=config.tile_n,
                             copy_tiles=operand_tile_minor_dims(config),
                             out_tile_n=config.tile_n, swizzles=(swizzle,))
  lhs, rhs, _ = operands.pad_operands(lhs, rhs, None, sizes)
  padded_m, padded_n = sizes.out
  m, n = problem.m, problem.n
  kernel = varying_kernel(plgpu.kernel(
      functools.partial(emit_pipelined_matmul, config=config),
      out_type=jax.ShapeDtypeStruct((padded_m, padded_n), out_dtype),
      grid=(pl.cdiv(padded_m, config.tile_m), pl.cdiv(padded_n, config.tile_n)),
      grid_names=(M_AXIS, N_AXIS),
      compiler_params=compiler_params(),
      interpret=interpret_params(),
      kernel_name="pipelined_matmul",
  ))
  out = kernel(lhs, rhs)
  return out if out.shape == (m, n) else out[:m, :n]
