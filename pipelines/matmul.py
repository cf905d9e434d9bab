"""`matmul`: the library's public matmul, backed by the warp-specialized kernel.

It validates the operands, picks a config (explicit, from the tuning cache, or
the heuristic in `heuristic.py`), and supports `jax.jit`, `jax.vmap`,
`jax.grad` (a `jax.custom_vjp` whose backward products run on the same
kernel, reading the operands in their stored layouts) and use inside
`jax.shard_map` (per-device shapes). The kernel call itself is
`kernel_call.ws_matmul`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from core.varying import cotangent_like
from pipelines import kernel_call, operands, tuning_cache
from pipelines.batching import batch_as_rows, refusing_gradient
from pipelines.config import FP8_DTYPE, TuningConfig, check_tuning_config
from pipelines.epilogue import Epilogue
from pipelines.heuristic import default_config, quantized_output_config

CACHE_MISS_MODES = ("heuristic", "tune", "error")

def choose_config(problem: operands.MatmulProblem, out_dtype, *,
                  on_cache_miss: str = "heuristic", lhs=None, rhs=None,
                  has_bias: bool = False) -> TuningConfig:
  """The cached config for `problem` (one the kernel runs, with a bias if
  `has_bias`), or what `on_cache_miss` says to do."""
  if on_cache_miss not in CACHE_MISS_MODES:
    raise ValueError(f"on_cache_miss={on_cache_miss!r} must be one of {CACHE_MISS_MODES}")
  cached = tuning_cache.lookup(problem, out_dtype, has_bias=has_bias)
  if cached is not None:
    return cached
  match on_cache_miss:
    case "error":
      raise LookupError(f"no tuned config for {tuning_cache.cache_key(problem, out_dtype)}; "
                        "run //tools:autotune_matmul for this shape")
    case "tune":
      from pipelines import autotune  # noqa: PLC0415 - only needed on this path.
      return autotune.tune(lhs, rhs, out_dtype=out_dtype, layout=problem.layout,
                           store=True).best.config
  return default_config(problem, out_dtype)


def matmul(lhs: jax.Array, rhs: jax.Array, bias: jax.Array | None = None, *,
           activation: str = "none", out_dtype=None, transpose_lhs: bool = False,
           transpose_rhs: bool = False, config: TuningConfig | None = None,
           on_cache_miss: str = "heuristic") -> jax.Array:
  """`activation(op(lhs) @ op(rhs) + bias)` on Hopper, fused in one kernel.

  Args:
    lhs: (M, K) float16 or bfloat16, or (K, M) with `transpose_lhs`.
    rhs: (K, N) of the same dtype, or (N, K) with `transpose_rhs`.
    bias: optional (N,) of any float dtype, added in float32 before the
      activation.
    activation: "none", "relu", "gelu" (tanh approximation) or "silu".
    out_dtype: float16, bfloat16 or float32; the operand dtype by default.
      Or float8_e4m3fn: the output quantized in the epilogue, one float32
      scale per row and 128 columns (each block's largest magnitude over
      e4m3's largest value, as `quantize_fp8(out, (1, 128))` has them), ready
      to be the LHS of `fp8_matmul` with no pass of its own. Its config is
      `heuristic.quantized_output_config` (the tuning cache holds none), and
      it is not differentiable.
    transpose_lhs, transpose_rhs: the operand is stored transposed and used
      as `lhs.T` / `rhs.T`. The kernel reads it as stored (no transpose copy
      in HBM), so `x.T @ y` and `x @ y.T` cost what `x @ y` does.
    config: a `TuningConfig`; by default the tuning cache's entry for this
      GPU, jax version, shape and layout, else what `on_cache_miss` says:
      "heuristic" (default), "tune" (sweep now, on a GPU) or "error".

  Any M, K and N work. The kernel reads an operand in place where its minor
  dimension is a multiple of 32 bytes and its major one of 8 (a last partial
  K step is filled with zeros), and an (M, K) LHS, an (N, K) RHS or a 16-bit
  output under 64-element tiles (the default K step and epilogue tile) with
  any M, K and N whose rows are a multiple of 16 bytes (TMA copies them as
  2D boxes); other dimensions are zero-padded, a copy of that operand
  (`operands.tma_sizes`). Where M,
  N or K is 0 no kernel runs and the result is what `jnp.dot` gives: an
  empty array, or for K = 0 `activation(bias)` (zeros without a bias).

  Gradients (`jax.grad`, `jax.vjp`): d lhs and d rhs are two more matmuls on
  this kernel in the layouts that read the saved operands as stored, with
  their own configs (the cache or heuristic for their shapes; `config`
  applies to the forward product only); d bias sums the rows. The
  activation's derivative multiplies the output cotangent in float32: for
  gelu and silu the forward kernel's epilogue writes it beside the output
  (in float16, or float32 for a float32 output: `epilogue.derivative_dtype`)
  only when the forward is differentiated, and for relu it is read off the
  saved output. The cotangent then enters the backward products in the
  operand dtype.
  Forward-mode differentiation (`jax.jvp`) is not supported.

  Returns:
    (M, N) array of `out_dtype`; for float8_e4m3fn, (values (M, N), scales
    (M, ceil(N / 128)) float32). Under `jax.vmap`, a batched `lhs` with an
    unbatched `rhs` runs as one (B*M, K) matmul (for an (M, K) lhs); other
    batchings loop.
  """
  layout = operands.OperandLayout(transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs)
  problem = operands.check_operands(lhs, rhs, layout)
  if config is not None:
    check_tuning_config(config)
  epilogue = Epilogue(activation=activation, has_bias=bias is not None)
  if out_dtype is not None and jnp.dtype(out_dtype) == FP8_DTYPE:
    if config is None:
      config = quantized_output_config(problem)
    return _make_quantized(config, epilogue, layout)(lhs, rhs, bias)
  out_dtype = operands.check_out_dtype(out_dtype, problem.dtype)
  if config is None and problem.is_empty:
    # Nothing to tune or launch: `ws_matmul` returns without a kernel.
    config = default_config(problem, out_dtype)
  if config is None:
    config = choose_config(problem, out_dtype, on_cache_miss=on_cache_miss, lhs=lhs, rhs=rhs,
                           has_bias=bias is not None)
  return _make_differentiable(config, epilogue, out_dtype, layout)(lhs, rhs, bias)


@functools.cache
def _make_quantized(config: TuningConfig, epilogue: Epilogue, layout: operands.OperandLayout):
  """(values, scales) of an output quantized to e4m3 in the epilogue; its
  gradient is an error, not a silent zero."""
  return refusing_gradient(
      _make_batchable(config, epilogue, FP8_DTYPE, layout),
      "matmul with out_dtype=float8_e4m3fn is not differentiable (its output is quantized); "
      "differentiate a 16- or 32-bit matmul, or use pipelines.fp8_linear for an FP8 layer")


@functools.cache
def _make_differentiable(config: TuningConfig, epilogue: Epilogue, out_dtype,
                         layout: operands.OperandLayout):
  run = _make_batchable(config, epilogue, out_dtype, layout)

  @jax.custom_vjp
  def differentiable(lhs, rhs, bias):
    return run(lhs, rhs, bias)

  def forward(lhs, rhs, bias):
    # Through a custom_vjp, so that differentiating this backward pass again
    # (grad of grad) never reaches the kernel's own rule-less primitive.
    if epilogue.keeps_derivative:
      # gelu's and silu's derivatives need the pre-activation: the forward
      # kernel's epilogue writes the derivative beside the output (in
      # `derivative_dtype`), rather than the backward recomputing the pre-activation
      # with a whole extra matmul. Keeping the derivative rather than the
      # pre-activation leaves the backward one multiply (a single XLA pass
      # with d bias; gelu's derivative there took two).
      out, derivative = _make_keeping_derivative(config, epilogue, out_dtype,
                                                 layout)(lhs, rhs, bias)
      return out, (lhs, rhs, bias, derivative)
    out = differentiable(lhs, rhs, bias)
    # relu's derivative is read off the output, which costs nothing to keep.
    return out, (lhs, rhs, bias, out if epilogue.activation == "relu" else None)

  def backward(residuals, out_cotangent):
    return _backward(epilogue, layout, residuals, out_cotangent)

  differentiable.defvjp(forward, backward)
  return differentiable


@functools.cache
def _make_keeping_derivative(config: TuningConfig, epilogue: Epilogue, out_dtype,
                             layout: operands.OperandLayout):
  """(output, the activation's derivative) from one kernel, differentiable in both."""
  run = _make_batchable(config, epilogue, out_dtype, layout, keep_derivative=True)

  @jax.custom_vjp
  def keeping(lhs, rhs, bias):
    return run(lhs, rhs, bias)

  def forward(lhs, rhs, bias):
    out, derivative = keeping(lhs, rhs, bias)
    return (out, derivative), (lhs, rhs, bias, derivative)

  def backward(residuals, cotangents):
    # Reached only by a second differentiation. The derivative's cotangent
    # is zero: its one reader, `_make_times_kept_derivative`, gives the operands
    # the second-order terms itself.
    out_cotangent, _ = cotangents
    return _backward(epilogue, layout, residuals, out_cotangent)

  keeping.defvjp(forward, backward)
  return keeping


def _backward(epilogue: Epilogue, layout: operands.OperandLayout, residuals, out_cotangent):
  """(d lhs, d rhs, d bias) from the output's cotangent.

  `residuals` is (lhs, rhs, bias, saved): `saved` is the activation's
  derivative for gelu and silu, the output for relu, None otherwise. The
  product with the derivative and the bias's row sum are elementwise work
  that XLA fuses into one pass over the cotangent; the cotangent then enters
  the backward products in the operand dtype.
  """
  lhs, rhs, bias, saved = residuals
  if epilogue.keeps_derivative:
    g = _make_times_kept_derivative(epilogue, layout)(out_cotangent, saved, lhs, rhs, bias)
  else:
    g = epilogue.sum_cotangent(out_cotangent, saved)
  return _operand_and_bias_cotangents(lhs, rhs, bias, g.astype(lhs.dtype), layout)


def _operand_and_bias_cotangents(lhs, rhs, bias, g, layout: operands.OperandLayout):
  """(d lhs, d rhs, d bias) of `op(lhs) @ op(rhs) + bias` for the cotangent g
  (M, N) of that sum, in the operand dtype."""
  # d bias sums the rounded cotangent that the products also take (in
  # float32), as XLA's autodiff of the same model does: summing the float32
  # one instead makes XLA write it out and read it back in a second pass.
  d_bias = None if bias is None else g.astype(jnp.float32).sum(axis=0).astype(bias.dtype)
  cotangents = (*operand_cotangents(lhs, rhs, g, layout), d_bias)
  return tuple(None if ct is None else cotangent_like(ct, primal)
               for ct, primal in zip(cotangents, (lhs, rhs, bias), strict=True))


@functools.cache
def _make_times_kept_derivative(epilogue: Epilogue, layout: operands.OperandLayout):
  """The backward's `out_cotangent * derivative` (float32 (M, N)), where
  `derivative` (float16, or float32 for a float32 output) is the kept
  act'(op(lhs) @ op(rhs) + bias), differentiable in the cotangent and, through
  the derivative, in lhs, rhs and bias.

  A second differentiation must not send a cotangent to the float16
  derivative: a cotangent has its primal's dtype, and one past float16's
  65504 (a loss summed over many tokens, then squared) would become inf.
  So the derivative's cotangent is zero here, and its effect, through the
  second derivative at the pre-activation (which is not kept: recomputed
  with one more product, in float32), goes straight to lhs, rhs and bias.
  """

  @jax.custom_vjp
  def times_kept_derivative(out_cotangent, derivative, lhs, rhs, bias):
    return epilogue.sum_cotangent(out_cotangent, derivative)

  def forward(out_cotangent, derivative, lhs, rhs, bias):
    return (times_kept_derivative(out_cotangent, derivative, lhs, rhs, bias),
            (out_cotangent, derivative, lhs, rhs, bias))

  def backward(residuals, cotangent):
    out_cotangent, derivative, lhs, rhs, bias = residuals
    pre_activation = matmul(lhs, rhs, bias, out_dtype=jnp.float32,
                            transpose_lhs=layout.transpose_lhs,
                            transpose_rhs=layout.transpose_rhs)
    sum_cotangent = (cotangent * out_cotangent.astype(jnp.float32)
                     * epilogue.second_derivative(pre_activation))
    d_out_cotangent = cotangent * derivative.astype(jnp.float32)
    return (cotangent_like(d_out_cotangent, out_cotangent), None,
            *_operand_and_bias_cotangents(lhs, rhs, bias, sum_cotangent.astype(lhs.dtype),
                                          layout))

  times_kept_derivative.defvjp(forward, backward)
  return times_kept_derivative


def operand_cotangents(lhs, rhs, g, layout: operands.OperandLayout):
  """(d lhs, d rhs) of `op(lhs) @ op(rhs)` for the cotangent g (M, N), each one
  matmul that reads lhs, rhs and g as they are stored, so no operand is
  transposed in HBM. With A = op(lhs), B = op(rhs): dA = g @ B.T, dB = A.T @ g,
  and a transposed operand gets the transposed cotangent (B @ g.T, g.T @ A).
  """
  t_lhs, t_rhs = layout.transpose_lhs, layout.transpose_rhs
  if t_lhs:  # d lhs = dA.T = B @ g.T, B stored as rhs.
    d_lhs = matmul(rhs, g, transpose_lhs=t_rhs, transpose_rhs=True)
  else:      # d lhs = dA = g @ B.T.
    d_lhs = matmul(g, rhs, transpose_rhs=not t_rhs)
  if t_rhs:  # d rhs = dB.T = g.T @ A, A stored as lhs.
    d_rhs = matmul(g, lhs, transpose_lhs=True, transpose_rhs=t_lhs)
  else:      # d rhs = dB = A.T @ g.
    d_rhs = matmul(lhs, g, transpose_lhs=not t_lhs)
  return d_lhs, d_rhs


@functools.cache
def _make_batchable(config: TuningConfig, epilogue: Epilogue, out_dtype,
                    layout: operands.OperandLayout, keep_derivative: bool = False):
  def run(lhs, rhs, bias):
    return kernel_call.ws_matmul(lhs, rhs, bias, config=config, epilogue=epilogue,
                                 out_dtype=out_dtype, layout=layout,
                                 keep_derivative=keep_derivative)

  return batch_as_rows(run, lhs_rows_leading=not layout.transpose_lhs)
