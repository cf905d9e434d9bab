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

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import SmemBudget, compiler_params, device_facts, interpret_params
from core.memory import SWIZZLE_BYTES, swizzle_bytes
from core.varying import vary_over, varying_axes, varying_kernel
from pipelines import operands
from pipelines.config import (
  FP8_DTYPE,
  FP8_SCALE_BLOCK,
  NUM_COMPUTE_WGS,
  OPERAND_DTYPES,
  Fp8Config,
  MatmulDimension,
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
from pipelines.epilogue import (
  PARTIAL_ROWS_BYTES,
  Epilogue,
  checked_bias,
  derivative_dtype,
  kept_derivative,
)
from pipelines.fp8_matmul_sm90 import (
    emit_fp8_matmul,
    emit_fp8_matmul_persistent,
    emit_fp8_matmul_warp_specialized,
)
from pipelines.fp8_quantize import ROW_BLOCK, quantize_fp8_reference, scales_shape
from pipelines.group_schedule import GroupRows, GroupTiles, group_rows, group_tiles
from pipelines.persistent_sm90 import (
    CLUSTER_AXIS,
    SM_AXIS,
    WG_AXIS,
    num_persistent_blocks,
    num_work_items,
)
from pipelines.pingpong_matmul_sm90 import emit_pingpong_matmul, pingpong_scratch
from pipelines.pipelined_matmul_sm90 import M_AXIS, N_AXIS, emit_pipelined_matmul


def ws_smem_budget(config: TuningConfig, problem: operands.MatmulProblem, out_dtype, *,
                   has_bias: bool = False, delay_release: int = 0,
                   gated: bool = False, grouped: bool = False,
                   ragged_k: bool = False, has_column_scales: bool = False) -> SmemBudget:
  """The SMEM the warp-specialized kernel of `config.schedule` allocates for `problem`
  (with `gated`, the cooperative body's gated unit, `ws_gated_matmul`; with
  `grouped`, its grouped matmul, `ws_ragged_matmul`; with `ragged_k`, the
  grouped matmul's weight gradient, `ws_ragged_k_matmul`; with
  `has_column_scales`, `ws_matmul`'s `column_scales`). For
  `config.swap_operands` or `config.transpose_rhs_first`, the SMEM of the
  kernel that runs it (`kernel_problem`)."""
  config, problem, out_dtype, has_bias = kernel_problem(config, problem, out_dtype, has_bias)
  if config.schedule == Schedule.PINGPONG:
    scratch = pingpong_scratch(config, problem.dtype, out_dtype, k=problem.k, has_bias=has_bias,
                               layout=problem.layout)
  else:
    scratch = cooperative_scratch(config, problem.dtype, out_dtype, k=problem.k,
                                  has_bias=has_bias, delay_release=delay_release,
                                  layout=problem.layout, gated=gated, grouped=grouped,
                                  ragged_k=ragged_k, has_column_scales=has_column_scales)
  return SmemBudget.of_scratch(
      scratch, labels={"pipeline_allocs": pipeline_buffer_names(config, gated=gated)})


def kernel_problem(config: TuningConfig, problem: operands.MatmulProblem, out_dtype,
                   has_bias: bool) -> tuple[TuningConfig, operands.MatmulProblem, jnp.dtype, bool]:
  """(config, problem, out_dtype, has_bias) of the kernel that runs `config` on
  `problem`: for `swap_operands`, out.T's problem
  (`MatmulProblem.transposed_product`) in float32, without a bias (`ws_matmul`
  adds it after the transpose); for `transpose_rhs_first`, the problem with
  its RHS stored (N, K); else the arguments."""
  if config.swap_operands:
    return (dataclasses.replace(config, swap_operands=False), problem.transposed_product(),
            jnp.dtype(jnp.float32), False)
  if config.transpose_rhs_first:
    return (dataclasses.replace(config, transpose_rhs_first=False), problem.with_rhs_transposed(),
            out_dtype, has_bias)
  return config, problem, out_dtype, has_bias


def check_ws_config(config: TuningConfig, problem: operands.MatmulProblem, out_dtype, *,
                    has_bias: bool = False, delay_release: int = 0,
                    kernel: str | None = None, gated: bool = False,
                    grouped: bool = False, ragged_k: bool = False,
                    has_column_scales: bool = False) -> None:
  """Raises `ValueError` unless the warp-specialized kernel can run `config` on `problem`.

  `problem.k` must be a multiple of `config.tile_k`: `ws_matmul` checks its
  K rounded up to whole K steps, the ring kernel its own.
  `delay_release` is a `pipeline_callback`'s hold on its slots
  (`emit_cooperative_matmul`). `kernel` names a kernel that calls
  `emit_cooperative_matmul` in blocks without clusters (the rings), which
  cannot run `config.cluster_m` = 2; None for `ws_matmul`, which can.
  `gated`: the config runs the gated unit (`ws_gated_matmul`), which needs
  the cooperative schedule without a split of K. `grouped`: the config runs
  the grouped matmul (`ws_ragged_matmul`), which also needs cluster_m=1 (the
  two blocks of a cluster could be on two groups' weights). `ragged_k`: the
  config runs the grouped matmul's weight gradient (`ws_ragged_k_matmul`),
  which needs what `grouped` does and wg_dimension M (each warpgroup zeroes
  the rows of other groups in its own LHS columns). `has_column_scales`: the
  epilogue scales the columns (`ws_matmul`'s `column_scales`), which needs
  the cooperative schedule without a split of K. An e4m3 `out_dtype` (the
  output quantized in the epilogue) needs that too, 128-column epilogue
  tiles (one quantization block each) and no cluster. `config.swap_operands`
  and `config.transpose_rhs_first` are `ws_matmul`'s alone, without column
  scales or a quantized output; the other fields are checked against the
  kernel that runs them (`kernel_problem`).
  """
  for name in ("swap_operands", "transpose_rhs_first"):
    if getattr(config, name) and (gated or grouped or ragged_k or has_column_scales
                                  or delay_release or kernel is not None
                                  or jnp.dtype(out_dtype) == FP8_DTYPE):
      raise ValueError(f"{config!r}: {name} runs only in ws_matmul's plain product, not in "
                       "the gated unit, the grouped matmul or a ring kernel, nor with column "
                       f"scales or a float8_e4m3fn output; use {name}=False")
  config, problem, out_dtype, has_bias = kernel_problem(config, problem, out_dtype, has_bias)
  if jnp.dtype(out_dtype) == FP8_DTYPE and (
      config.schedule != Schedule.COOPERATIVE or config.k_splits != 1
      or config.epi_tile_n != FP8_SCALE_BLOCK or config.cluster_m != 1):
    raise ValueError(f"{config!r}: an output quantized to float8_e4m3fn needs "
                     f"schedule=Schedule.COOPERATIVE, k_splits=1, cluster_m=1 and "
                     f"epi_tile_n={FP8_SCALE_BLOCK} (one quantization block)")
  if has_column_scales and (config.schedule != Schedule.COOPERATIVE or config.k_splits != 1):
    raise ValueError(f"{config!r}: column scales need schedule=Schedule.COOPERATIVE and "
                     "k_splits=1")
  if gated and (config.schedule != Schedule.COOPERATIVE or config.k_splits != 1):
    raise ValueError(f"{config!r}: the gated unit needs schedule=Schedule.COOPERATIVE and "
                     "k_splits=1")
  if grouped and (config.schedule != Schedule.COOPERATIVE or config.k_splits != 1
                  or config.cluster_m != 1):
    raise ValueError(f"{config!r}: the grouped matmul needs schedule=Schedule.COOPERATIVE, "
                     "k_splits=1 and cluster_m=1")
  # The rows at a group's edge go out from any row of a plain SMEM tile,
  # in chunks of PARTIAL_ROWS_BYTES a row (`epilogue.partial_rows_width`).
  row_bytes = config.epi_tile_n * jnp.dtype(out_dtype).itemsize
  if grouped and row_bytes % PARTIAL_ROWS_BYTES:
    raise ValueError(f"{config!r}: the grouped matmul stores the rows at a group's edge in "
                     f"chunks of {PARTIAL_ROWS_BYTES} bytes a row; epi_tile_n="
                     f"{config.epi_tile_n} of {jnp.dtype(out_dtype).name} is {row_bytes} bytes: "
                     f"use a multiple of {PARTIAL_ROWS_BYTES // jnp.dtype(out_dtype).itemsize}")
  if ragged_k and (config.schedule != Schedule.COOPERATIVE or config.k_splits != 1
                   or config.cluster_m != 1 or config.wg_dimension != MatmulDimension.M):
    raise ValueError(f"{config!r}: the grouped matmul's weight gradient needs "
                     "schedule=Schedule.COOPERATIVE, k_splits=1, cluster_m=1 and "
                     "wg_dimension=MatmulDimension.M")
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
    ws_smem_budget(config, problem, out_dtype, has_bias=has_bias, delay_release=delay_release,
                   gated=gated, grouped=grouped, ragged_k=ragged_k,
                   has_column_scales=has_column_scales).check(what=repr(config))


def ws_tma_sizes(config: TuningConfig, problem: operands.MatmulProblem,
                 out_dtype) -> operands.TmaSizes:
  """The shapes `ws_matmul` pads the operands and its output to for `config`
  (`operands.tma_sizes`), a config without `swap_operands` or
  `transpose_rhs_first` (for one with them, `kernel_problem` gives the
  kernel's config and problem)."""
  # K is never padded: TMA fills what a last K step, or a split's last K
  # range, reads past the end with zeros (`TuningConfig.split_k_steps`).
  return operands.tma_sizes(problem, out_dtype=config.store_dtype(out_dtype),
                            k_multiple=1, tile_m=config.cta_tile_m,
                            tile_n=config.cta_tile_n,
                            copy_tiles=operand_tile_minor_dims(
                                config, transpose_lhs=problem.layout.transpose_lhs,
                                transpose_rhs=problem.layout.transpose_rhs),
                            out_tile_n=config.epi_tile_n,
                            rhs_multicast=config.cluster_m > 1)


# A quantized output's row maxima reduce within warps (each row of a wgmma
# accumulator lives in one warp), so its kernels need no cross-warp scratch
# in SMEM; Mosaic GPU otherwise reserves 2048 bytes for any reduction, beyond
# what the SMEM budgets count.
NO_REDUCTION_SCRATCH = 0


def persistent_kernel(body, *, out_type, num_blocks: int, name: str, collective_axes=(),
                      cluster_size: int = 1, reduction_scratch_bytes: int | None = None,
                      compute_wgs: int = NUM_COMPUTE_WGS):
  """`plgpu.kernel` for a warp-specialized body: `num_blocks` persistent blocks on
  `SM_AXIS`, `compute_wgs` compute warpgroups and a memory warpgroup on `WG_AXIS`.

  `reduction_scratch_bytes` is `core.compiler.compiler_params`'s (None: Mosaic
  GPU's default, which a body that reduces only within warps need not pay).

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
      num_threads=compute_wgs + 1,
      thread_name=WG_AXIS,
      compiler_params=compiler_params(reduction_scratch_bytes=reduction_scratch_bytes),
      interpret=interpret_params(),
      kernel_name=name,
  ), collective_axes=collective_axes)


def _check_call(lhs, rhs, bias, out_dtype, layout: operands.OperandLayout = operands.NN,
                dtypes: tuple = OPERAND_DTYPES):
  """Step 1: (problem, out dtype, bias as float32 or None)."""
  problem = operands.check_operands(lhs, rhs, layout, dtypes)
  out_dtype = operands.check_out_dtype(out_dtype, problem.dtype)
  return problem, out_dtype, checked_bias(bias, problem.n)


def empty_result(problem: operands.MatmulProblem, out_dtype, operands_in: tuple, bias=None,
                 epilogue: Epilogue = Epilogue()) -> jax.Array:
  """Step 3: `jnp.dot`'s answer where M, N or K is 0, with no kernel (the
  epilogue of zeros, which has no elements unless only K is 0), typed as
  varying like the kernel's result would be (`operands_in`: its arguments)."""
  zeros = vary_over(jnp.zeros((problem.m, problem.n), jnp.float32), varying_axes(operands_in))
  return epilogue.apply_to_sum(zeros, bias).astype(out_dtype)


def ws_matmul(lhs: jax.Array, rhs: jax.Array, bias: jax.Array | None = None, *,
              config: TuningConfig, epilogue: Epilogue = Epilogue(),
              out_dtype=None, layout: operands.OperandLayout = operands.NN,
              keep_derivative: bool = False,
              column_scales: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
  """`epilogue(op(lhs) @ op(rhs) + bias)` with the warp-specialized kernel and a given config.

  Where M, N or K is 0 no kernel runs: the result is what `jnp.dot` gives
  (an empty array, or for K = 0 the epilogue of zeros). Dimensions off what
  TMA needs are zero-padded (`operands.tma_sizes`), which copies the
  operand: a major dimension to a multiple of 8; a minor one off 128 bytes
  to a multiple of 128 bytes, unless the kernel reading it in place with a
  narrower swizzle is modelled faster (never where it is off 32 bytes). K
  never is: a split K's last range may end past it (`TuningConfig.split_k_steps`).
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
      Or float8_e4m3fn: the output quantized in the epilogue in (1, 128)
      blocks, as `quantize_fp8` quantizes (config with 128-column epilogue
      tiles, the cooperative schedule and k_splits = 1; no
      `keep_derivative`).
    layout: how lhs and rhs are stored (`operands.OperandLayout`).
    keep_derivative: also return the activation's derivative at the
      pre-activation `op(lhs) @ op(rhs) + bias` (what a backward pass
      needs), written by the same epilogue in
      `epilogue.derivative_dtype(out_dtype)`.
    column_scales: (N,) float32, or None: the product's columns are
      multiplied by them in the epilogue, before the bias. With them the
      operands may also be float8_e4m3fn (dequantized by the scales), stored
      (M, K) and (N, K) (`OperandLayout(transpose_rhs=True)`: wgmma reads
      8-bit operands K-major only), with an explicit `out_dtype`. Needs the
      cooperative schedule and k_splits = 1.

  Returns:
    (M, N) array of `out_dtype`, accumulated in float32; with
    `keep_derivative`, a pair (output, (M, N) derivative); for float8_e4m3fn,
    a pair (values (M, N), scales (M, ceil(N / 128)) float32).
  """
  if (bias is not None) != epilogue.has_bias:
    raise ValueError(f"bias is {'given' if bias is not None else 'missing'} but "
                     f"epilogue.has_bias={epilogue.has_bias}")
  scaled = column_scales is not None
  quantized = out_dtype is not None and jnp.dtype(out_dtype) == FP8_DTYPE
  if quantized and keep_derivative:
    raise ValueError("keep_derivative needs a 16- or 32-bit out_dtype, not float8_e4m3fn")
  problem, out_dtype, bias = _check_call(lhs, rhs, bias, None if quantized else out_dtype,
                                         layout,
                                         (*OPERAND_DTYPES, FP8_DTYPE) if scaled else OPERAND_DTYPES)
  if quantized:
    out_dtype = FP8_DTYPE
  if problem.dtype == FP8_DTYPE and (layout.transpose_lhs or not layout.transpose_rhs):
    raise ValueError(f"float8_e4m3fn operands must be stored (M, K) and (N, K) "
                     f"(OperandLayout(transpose_rhs=True)), got {layout=}")
  if scaled and (column_scales.shape, jnp.dtype(column_scales.dtype)) != (
      (problem.n,), jnp.dtype(jnp.float32)):
    raise ValueError(f"column_scales must be ({problem.n},) float32, got "
                     f"{column_scales.shape} {jnp.dtype(column_scales.dtype).name}")
  check_ws_config(config, operands.pad_k(problem, config.tile_k), out_dtype,
                  has_bias=bias is not None, has_column_scales=scaled)
  if problem.is_empty:
    if quantized:
      return quantize_fp8_reference(
          empty_result(problem, jnp.float32, (lhs, rhs), bias, epilogue), ROW_BLOCK)
    out = empty_result(problem, out_dtype, (lhs, rhs), bias, epilogue)
    if not keep_derivative:
      return out
    pre_activation = empty_result(problem, jnp.float32, (lhs, rhs), bias, Epilogue())
    return out, epilogue.derivative(pre_activation).astype(derivative_dtype(out_dtype))
  if config.transpose_rhs_first:
    # The kernel reads the RHS as (N, K) rows; XLA copies a (K, N) one.
    return ws_matmul(lhs, rhs if layout.transpose_rhs else rhs.T, bias,
                     config=dataclasses.replace(config, transpose_rhs_first=False),
                     epilogue=epilogue, out_dtype=out_dtype,
                     layout=dataclasses.replace(layout, transpose_rhs=True),
                     keep_derivative=keep_derivative, column_scales=column_scales)
  if config.swap_operands:
    return _ws_transposed_product(lhs, rhs, bias, config=config, epilogue=epilogue,
                                  out_dtype=out_dtype, problem=problem,
                                  keep_derivative=keep_derivative)
  store_dtype = config.store_dtype(out_dtype)
  sizes = ws_tma_sizes(config, problem, out_dtype)
  lhs, rhs, bias = operands.pad_operands(lhs, rhs, bias, sizes)
  padded_m, padded_n = sizes.out
  if scaled:
    column_scales = operands.zero_pad(column_scales, (padded_n,))
  m, n = problem.m, problem.n
  kernel_bias, kernel_epilogue = (bias, epilogue) if config.fuses_epilogue else (None, Epilogue())
  emit = (emit_pingpong_matmul if config.schedule == Schedule.PINGPONG
          else emit_cooperative_matmul)

  kernel_keeps_derivative = keep_derivative and config.fuses_epilogue
  num_outputs = 2 if kernel_keeps_derivative or quantized else 1

  def body(lhs_gmem, rhs_gmem, *rest):
    inputs, (out_gmem, *second_gmem) = rest[:-num_outputs], rest[-num_outputs:]
    bias_gmem = inputs[:kernel_bias is not None]
    extra = dict(column_scales_gmem=inputs[-1]) if scaled else {}
    if second_gmem:
      extra["out_scales_gmem" if quantized else "derivative_gmem"] = second_gmem[0]
    emit(lhs_gmem, rhs_gmem, out_gmem, *bias_gmem, config=config, epilogue=kernel_epilogue,
         layout=layout, **extra)

  splits = (config.k_splits,) if config.k_splits > 1 else ()
  work_items = num_work_items(config, pl.cdiv(padded_m, config.cta_tile_m),
                              pl.cdiv(padded_n, config.cta_tile_n))
  num_blocks = num_persistent_blocks(config, work_items, device_facts().sm_count)
  out_type = jax.ShapeDtypeStruct((*splits, padded_m, padded_n), store_dtype)
  out_types = (out_type,) * num_outputs
  if quantized:
    # One scale per row and 128 columns, stored transposed (each sub-tile's
    # scales are one contiguous row), over whole CTA tiles so that no
    # store of them reaches past the array.
    out_types = (out_type, jax.ShapeDtypeStruct(
        (operands.round_up(padded_n, config.cta_tile_n) // FP8_SCALE_BLOCK,
         operands.round_up(padded_m, config.cta_tile_m)), jnp.float32))
  kernel = persistent_kernel(
      body, out_type=out_types,
      num_blocks=num_blocks, cluster_size=config.cluster_m,
      name=f"ws_matmul_{config.schedule.value}_{layout.name}",
      reduction_scratch_bytes=NO_REDUCTION_SCRATCH if quantized else None)
  outs = kernel(lhs, rhs, *(() if kernel_bias is None else (kernel_bias,)),
                *((column_scales,) if scaled else ()))
  if not config.fuses_epilogue:
    # One XLA fusion reads the partials once: sum, bias, activation, cast.
    outs = _epilogue_in_xla(outs[0][:, :m, :n].sum(axis=0), None if bias is None else bias[:n],
                            epilogue=epilogue, out_dtype=out_dtype,
                            keep_derivative=keep_derivative)
  elif quantized:
    values, scales = outs
    return values[:m, :n], scales.T[:m, :scales_shape((m, n), ROW_BLOCK)[1]]
  else:
    outs = tuple(out if out.shape == (m, n) else out[:m, :n] for out in outs)
    if keep_derivative:
      outs = (outs[0], kept_derivative(outs[1], out_dtype))
  return outs if keep_derivative else outs[0]


def _ws_transposed_product(lhs, rhs, bias, *, config: TuningConfig, epilogue: Epilogue,
                           out_dtype, problem: operands.MatmulProblem, keep_derivative: bool):
  """`ws_matmul` for a config with `swap_operands`: the kernel writes out.T =
  op(rhs).T @ op(lhs).T in float32 (or its K ranges' partials), and one XLA
  pass sums, transposes, adds the bias and applies the activation. A (K, M)
  LHS is transposed by XLA first (`MatmulProblem.transposed_product`)."""
  kernel_config, transposed, _, _ = kernel_problem(config, problem, jnp.float32, False)
  if problem.layout.transpose_lhs:
    lhs = lhs.T  # The kernel reads the activations as (N', K) rows.
  product = ws_matmul(rhs, lhs, config=kernel_config, out_dtype=jnp.float32,
                      layout=transposed.layout)
  outs = _epilogue_in_xla(product.T, bias, epilogue=epilogue, out_dtype=out_dtype,
                          keep_derivative=keep_derivative)
  return outs if keep_derivative else outs[0]


def _epilogue_in_xla(product, bias, *, epilogue: Epilogue, out_dtype,
                     keep_derivative: bool) -> tuple[jax.Array, ...]:
  """(output,) or (output, derivative) of `epilogue` applied by XLA to a float32
  (M, N) `product` that a kernel left without it (a split K's summed partials,
  the transposed product's transpose), with `bias` (N,) or None."""
  out, derivative = epilogue.apply_and_derivative(Epilogue().apply_to_sum(product, bias))
  return (out.astype(out_dtype),
          *((derivative.astype(derivative_dtype(out_dtype)),) if keep_derivative else ()))


def ws_gated_matmul(lhs: jax.Array, gate_rhs: jax.Array, up_rhs: jax.Array | None, *,
                    config: TuningConfig, activation: str, out_dtype=None,
                    layout: operands.OperandLayout = operands.NN,
                    keep_products: bool = False):
  """`activation(op(lhs) @ op(gate_rhs)) * (op(lhs) @ op(up_rhs))` in one kernel.

  The cooperative body loads each LHS tile once for both products, and each
  compute warpgroup keeps an accumulator for each (`emit_cooperative_matmul`
  with `up_gmem`). Shapes and padding as for `ws_matmul`.

  Args:
    lhs: (M, K) float16 or bfloat16, or (K, M) with `layout.transpose_lhs`.
    gate_rhs: (K, N) of the same dtype, or (N, K) with `layout.transpose_rhs`;
      or with `up_rhs` None, one fused (K, 2N) weight (not transposed) whose
      columns [0, N) are the gate's and [N, 2N) the up projection's.
    up_rhs: stored as `gate_rhs` is, or None (fused).
    config: a cooperative `TuningConfig` with k_splits = 1; each warpgroup
      holds two (tile_m, tile_n) accumulators.
    activation: "none", "relu", "gelu" or "silu", applied to the gate.
    out_dtype: float16, bfloat16 or float32; the operand dtype by default.
    layout: how lhs and the weights are stored.
    keep_products: also return the two products (the gate's pre-activation
      and the up projection), written by the same epilogue in `out_dtype`.

  Returns:
    (M, N) array of `out_dtype`; with `keep_products`, a triple (output,
    gate product, up product) of such arrays.
  """
  fused = up_rhs is None
  if fused:
    if layout.transpose_rhs or gate_rhs.ndim != 2 or gate_rhs.shape[-1] % 2:
      raise ValueError(f"a fused weight must be (K, 2N), not transposed; got "
                       f"{gate_rhs.shape=} with {layout=}")
    n = gate_rhs.shape[1] // 2
    gate_shape = (gate_rhs.shape[0], n)
  else:
    if (gate_rhs.shape, gate_rhs.dtype) != (up_rhs.shape, up_rhs.dtype):
      raise ValueError(f"gate_rhs and up_rhs must have one shape and dtype, got "
                       f"{gate_rhs.shape=} {gate_rhs.dtype}, {up_rhs.shape=} {up_rhs.dtype}")
    gate_shape = gate_rhs.shape
  epilogue = Epilogue(activation=activation)
  problem, out_dtype, _ = _check_call(lhs, jax.ShapeDtypeStruct(gate_shape, gate_rhs.dtype),
                                      None, out_dtype, layout)
  check_ws_config(config, operands.pad_k(problem, config.tile_k), out_dtype, gated=True)
  if problem.is_empty:  # Both products are zeros, and so is act(0) * 0.
    zeros = empty_result(problem, out_dtype, (lhs, gate_rhs))
    return (zeros, zeros, zeros) if keep_products else zeros
  sizes = ws_tma_sizes(config, problem, out_dtype)
  if fused and (sizes.rhs != gate_shape or n * gate_rhs.dtype.itemsize % max(SWIZZLE_BYTES)):
    # The fused view cannot be padded in place, and TMA needs its up half
    # (at column N) to start on 16 bytes: pad the two halves apart, which
    # copies them as any padding does. So are halves whose rows are off
    # 128 bytes: their tiles would take a narrower swizzle, and Mosaic GPU
    # (jax 0.11.2) fails to infer the layouts of such views ("Failed to
    # infer a possible set of layouts"), where two separate arrays of the
    # same shape lower. Model widths (N = 8192, 14336, 18944, ...) are
    # multiples of 64 and read in place.
    gate_rhs, up_rhs = gate_rhs[:, :n], gate_rhs[:, n:]
    fused = False
  if fused:  # Read in place.
    lhs = operands.pad_operands(lhs, None, None, sizes)[0]
  else:
    lhs, gate_rhs, _ = operands.pad_operands(lhs, gate_rhs, None, sizes)
    up_rhs = operands.pad_operands(None, up_rhs, None, sizes)[1]
  padded_m, padded_n = sizes.out
  m, n = problem.m, problem.n
  num_outputs = 3 if keep_products else 1

  def body(lhs_gmem, gate_gmem, *rest):
    if fused:
      # The two halves of the (K, 2N) weight, as (K, N) views of it.
      (out_gmem, *kept_gmem), up_gmem = rest, gate_gmem.at[:, pl.ds(n, n)]
      gate_gmem = gate_gmem.at[:, pl.ds(0, n)]
    else:
      up_gmem, out_gmem, *kept_gmem = rest
    pre_activation_gmem, up_product_gmem = kept_gmem or (None, None)
    emit_cooperative_matmul(lhs_gmem, gate_gmem, out_gmem, config=config, epilogue=epilogue,
                            layout=layout, up_gmem=up_gmem,
                            pre_activation_gmem=pre_activation_gmem,
                            up_product_gmem=up_product_gmem)

  work_items = num_work_items(config, pl.cdiv(padded_m, config.cta_tile_m),
                              pl.cdiv(padded_n, config.cta_tile_n))
  num_blocks = num_persistent_blocks(config, work_items, device_facts().sm_count)
  kernel = persistent_kernel(
      body, out_type=(jax.ShapeDtypeStruct((padded_m, padded_n), out_dtype),) * num_outputs,
      num_blocks=num_blocks, cluster_size=config.cluster_m,
      name=f"ws_gated_matmul_{layout.name}")
  outs = tuple(out if out.shape == (m, n) else out[:m, :n]
               for out in kernel(lhs, *((gate_rhs,) if fused else (gate_rhs, up_rhs))))
  return outs if keep_products else outs[0]


def ws_ragged_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                     config: TuningConfig, epilogue: Epilogue = Epilogue(), out_dtype=None,
                     transpose_rhs: bool = False, keep_derivative: bool = False):
  """The grouped matmul: `epilogue(lhs[rows of g] @ op(rhs[g]))` for each group g, in one kernel.

  The rows of `lhs` are grouped in order, group g holding `group_sizes[g]`
  of them (`jax.lax.ragged_dot`'s semantics); rows past the groups give
  zeros. The group sizes are read on the device (`group_schedule`), so new
  sizes need no new kernel. Shapes and padding as for `ws_matmul`, with
  each group's weight padded as one RHS would be.

  Args:
    lhs: (M, K) float16 or bfloat16.
    rhs: (G, K, N) of the same dtype, or (G, N, K) with `transpose_rhs`.
    group_sizes: (G,) integers; sizes past M are cut at row M.
    config: a cooperative `TuningConfig` with k_splits = 1 and cluster_m = 1.
    epilogue: the activation (no bias: `epilogue.has_bias` must be False).
    out_dtype: float16, bfloat16 or float32; the operand dtype by default.
    transpose_rhs: whether each weight is stored (N, K).
    keep_derivative: also return the activation's derivative at the
      product, written by the same epilogue in
      `epilogue.derivative_dtype(out_dtype)` (that of the identity at the
      rows past the groups).

  Returns:
    (M, N) array of `out_dtype`, accumulated in float32; with
    `keep_derivative`, a pair (output, (M, N) derivative).
  """
  if epilogue.has_bias:
    raise ValueError("the grouped matmul takes no bias (epilogue.has_bias must be False)")
  layout = operands.OperandLayout(transpose_rhs=transpose_rhs)
  problem, out_dtype, _ = _check_call(lhs, jax.ShapeDtypeStruct(rhs.shape[1:], rhs.dtype), None,
                                      out_dtype, layout)
  check_ws_config(config, operands.pad_k(problem, config.tile_k), out_dtype, grouped=True)
  num_outputs = 2 if keep_derivative else 1
  if problem.is_empty:  # Every product is zeros, and act(0) = 0.
    zeros = empty_result(problem, jnp.float32, (lhs, rhs, group_sizes))
    if not keep_derivative:
      return zeros.astype(out_dtype)
    return zeros.astype(out_dtype), epilogue.derivative(zeros).astype(derivative_dtype(out_dtype))
  sizes = ws_tma_sizes(config, problem, out_dtype)
  lhs = operands.zero_pad(lhs, sizes.lhs)
  rhs = operands.zero_pad(rhs, sizes.rhs)  # Each group's weight.
  padded_m, padded_n = sizes.out
  m, n = problem.m, problem.n
  tiles = group_tiles(group_sizes, m, config.cta_tile_m)

  def body(lhs_gmem, rhs_gmem, group_gmem, row_start_gmem, rows_gmem, out_gmem,
           *derivative_gmem):
    emit_cooperative_matmul(
        lhs_gmem, rhs_gmem, out_gmem, config=config, epilogue=epilogue, layout=layout,
        derivative_gmem=derivative_gmem[0] if derivative_gmem else None,
        group_tiles=GroupTiles(group=group_gmem, row_start=row_start_gmem, rows=rows_gmem))

  work_items = tiles.group.shape[0] * pl.cdiv(padded_n, config.cta_tile_n)
  kernel = persistent_kernel(
      body, out_type=(jax.ShapeDtypeStruct((padded_m, padded_n), out_dtype),) * num_outputs,
      num_blocks=num_persistent_blocks(config, work_items, device_facts().sm_count),
      name=f"ws_ragged_matmul_{layout.name}")
  outs = tuple(out if out.shape == (m, n) else out[:m, :n]
               for out in kernel(lhs, rhs, tiles.group, tiles.row_start, tiles.rows))
  if not keep_derivative:
    return outs[0]
  return outs[0], kept_derivative(outs[1], out_dtype)


def ws_ragged_k_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                       config: TuningConfig, out_dtype=None) -> jax.Array:
  """The grouped matmul's weight gradient: `lhs[rows of g].T @ rhs[rows of g]` for each group g.

  A matmul whose K (the rows) is ragged: the rows of both operands are
  grouped in order, group g holding `group_sizes[g]` of them, and each
  group's product is an output of its own (zeros for an empty group). Read
  on the device (`group_schedule.group_rows`), so new sizes need no new
  kernel. This is `jax.lax.ragged_dot`'s d rhs (lhs the forward's LHS, rhs
  the output cotangent), and, swapped, that of a weight stored (N, K).

  Args:
    lhs: (M, K) float16 or bfloat16, read transposed as stored.
    rhs: (M, N) of the same dtype.
    group_sizes: (G,) integers; sizes past M are cut at row M, rows past
      their sum take part in no product.
    config: a cooperative `TuningConfig` with k_splits = 1, cluster_m = 1
      and wg_dimension M.
    out_dtype: float16, bfloat16 or float32; the operand dtype by default.

  Returns:
    (G, K, N) array of `out_dtype`, accumulated in float32.
  """
  layout = operands.OperandLayout(transpose_lhs=True)
  # As a matmul: M is lhs's K (the output's rows), K the grouped rows.
  problem, out_dtype, _ = _check_call(lhs, rhs, None, out_dtype, layout)
  check_ws_config(config, operands.pad_k(problem, config.tile_k), out_dtype, ragged_k=True)
  num_groups = group_sizes.shape[0]
  if problem.m == 0 or problem.n == 0 or problem.k == 0 or num_groups == 0:
    return vary_over(jnp.zeros((num_groups, problem.m, problem.n), out_dtype),
                     varying_axes((lhs, rhs, group_sizes)))
  sizes = ws_tma_sizes(config, problem, out_dtype)
  lhs, rhs, _ = operands.pad_operands(lhs, rhs, None, sizes)
  padded_m, padded_n = sizes.out
  rows = group_rows(group_sizes, problem.k)

  def body(lhs_gmem, rhs_gmem, start_gmem, end_gmem, out_gmem):
    emit_cooperative_matmul(lhs_gmem, rhs_gmem, out_gmem, config=config, layout=layout,
                            group_rows=GroupRows(start=start_gmem, end=end_gmem))

  work_items = num_groups * pl.cdiv(padded_m, config.cta_tile_m) * pl.cdiv(padded_n,
                                                                            config.cta_tile_n)
  kernel = persistent_kernel(
      body, out_type=jax.ShapeDtypeStruct((num_groups, padded_m, padded_n), out_dtype),
      num_blocks=num_persistent_blocks(config, work_items, device_facts().sm_count),
      name="ws_ragged_k_matmul")
  out = kernel(lhs, rhs, rows.start, rows.end)
  if out.shape[1:] != (problem.m, problem.n):
    out = out[:, :problem.m, :problem.n]
  return out


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


def fp8_block_scaled_matmul(lhs: jax.Array, rhs: jax.Array, lhs_scales: jax.Array,
                            rhs_scales: jax.Array, bias: jax.Array | None, *,
                            config: Fp8Config, epilogue: Epilogue, out_dtype,
                            rhs_row_scales: bool = False) -> jax.Array:
  """The block-scaled FP8 kernel (`fp8_matmul_sm90`) on checked operands (`fp8.fp8_matmul`).

  Args:
    lhs: (M, K) float8_e4m3fn; rhs: (N, K) float8_e4m3fn.
    lhs_scales: (M, ceil(K / 128)) float32; rhs_scales: (ceil(N / 128),
      ceil(K / 128)) float32, or with `rhs_row_scales` (N, ceil(K / 128)).
    bias: (N,) float32 or None (`epilogue.has_bias`).
    config, epilogue, out_dtype: as `fp8.fp8_matmul` takes them.

  Pads what the kernel needs: K to whole scale blocks (zeros, which add
  nothing whatever their scale), N to whole tiles and M to whole tiles of
  `config.cta_tile_m` rows (zeros, sliced off the result), each RHS
  block-scale row to whole 16-byte TMA units; and stores the per-row scales
  transposed. The persistent kernel reads and writes M in place instead
  (`_persistent_rows`). Aligned operands are not copied; the scales, 1/128
  of the operands' elements, always are.

  Returns:
    (M, N) array of `out_dtype`; for float8_e4m3fn, (values (M, N), scales
    (M, ceil(N / 128)) float32): the output quantized in (1, 128) blocks.
  """
  m, k = lhs.shape
  n = rhs.shape[0]
  quantized = jnp.dtype(out_dtype) == FP8_DTYPE
  if not (m and n and k):
    problem = operands.MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(jnp.bfloat16))
    out = empty_result(problem, jnp.float32, (lhs, rhs, lhs_scales, rhs_scales), bias, epilogue)
    return quantize_fp8_reference(out, ROW_BLOCK) if quantized else out.astype(out_dtype)
  tile_m, tile_n, tile_k = config.cta_tile_m, Fp8Config.TILE_N, Fp8Config.TILE_K
  padded_m = (_persistent_rows(m, tile_m) if config.runs_persistent
              else operands.round_up(m, tile_m))
  padded_n = operands.round_up(n, tile_n)
  padded_k = operands.round_up(k, tile_k)
  k_steps = padded_k // tile_k
  config.smem_budget(k_steps, out_dtype, has_bias=bias is not None,
                     rhs_row_scales=rhs_row_scales).check(what=repr(config))

  lhs = operands.zero_pad(lhs, (padded_m, padded_k))
  rhs = operands.zero_pad(rhs, (padded_n, padded_k))
  lhs_scales = operands.zero_pad(lhs_scales, (padded_m, k_steps)).T
  if rhs_row_scales:
    rhs_scales = operands.zero_pad(rhs_scales, (padded_n, k_steps)).T
  else:
    rhs_scales = operands.zero_pad(rhs_scales, (padded_n // tile_n,
                                                Fp8Config.scale_row_length(k_steps)))
  args = (lhs, rhs, lhs_scales, rhs_scales)
  if bias is not None:
    args += (operands.zero_pad(bias, (padded_n,)),)
  out_type = jax.ShapeDtypeStruct((padded_m, padded_n), out_dtype)
  if quantized:  # And the output's scales, one per row and TILE_N columns, transposed.
    out_type = (out_type, jax.ShapeDtypeStruct((padded_n // tile_n, padded_m), jnp.float32))
  if config.runs_persistent:
    tiles = pl.cdiv(padded_m, tile_m) * (padded_n // tile_n)
    kernel = persistent_kernel(
        functools.partial(emit_fp8_matmul_persistent, config=config, epilogue=epilogue,
                          rhs_row_scales=rhs_row_scales),
        out_type=out_type,
        num_blocks=num_persistent_blocks(config.tile_order, tiles, device_facts().sm_count),
        name="fp8_block_scaled_matmul_persistent",
        reduction_scratch_bytes=NO_REDUCTION_SCRATCH, compute_wgs=config.compute_wgs)
    return _fp8_result(kernel(*args), m, n, quantized)
  body = emit_fp8_matmul if config.compute_wgs == 1 else emit_fp8_matmul_warp_specialized
  # The warp-specialized body runs its compute warpgroups and a memory warpgroup.
  threads = (dict(num_threads=NUM_COMPUTE_WGS + 1, thread_name=WG_AXIS)
             if config.compute_wgs > 1 else {})
  kernel = varying_kernel(plgpu.kernel(
      functools.partial(body, config=config, epilogue=epilogue, rhs_row_scales=rhs_row_scales),
      out_type=out_type,
      grid=(padded_m // tile_m, padded_n // tile_n),
      grid_names=(M_AXIS, N_AXIS),
      **threads,
      compiler_params=compiler_params(reduction_scratch_bytes=NO_REDUCTION_SCRATCH),
      interpret=interpret_params(),
      kernel_name="fp8_block_scaled_matmul",
  ))
  return _fp8_result(kernel(*args), m, n, quantized)


def _persistent_rows(m: int, tile_m: int) -> int:
  """The rows the persistent FP8 kernel's arrays take for M: M itself where
  it is a multiple of 8 and at least one tile (TMA zero-fills the last
  tile's loads past M and drops its stores past M), so that a 192-row tile
  on M = 8192 copies neither the LHS nor the output; else the next multiple
  of 8 (a tiled copy's rows), and at least the tile, whose copies are not
  masked correctly where the array is narrower than them (the transposed
  LHS scales' rows are M long; `operands.tma_sizes`)."""
  return max(operands.round_up(m, 8), tile_m)


def _fp8_result(out, m: int, n: int, quantized: bool):
  """The (m, n) result of the FP8 kernel's padded outputs; for an e4m3 output,
  (values (m, n), scales (m, ceil(n / 128)))."""
  if quantized:
    values, scales = out
    return values[:m, :n], scales.T[:m]
  return out if out.shape == (m, n) else out[:m, :n]
