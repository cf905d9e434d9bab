"""`gated_linear_unit`: `activation(x @ w_gate) * (x @ w_up)` in one kernel, with gradients.

The gated unit is the up projection of the MLP in Llama-, Qwen-, Mistral- and
Gemma-style transformers (SwiGLU with silu, GeGLU with gelu). The forward is
one warp-specialized kernel (`kernel_call.ws_gated_matmul`) that loads each
x tile once for both products and writes only the (M, N) output; under
differentiation the same kernel's epilogue also writes the two products,
which is all the backward needs, so no product is recomputed.

The backward (a `jax.custom_vjp`) is one XLA pass over the cotangent and the
two products, then matmuls on our kernel that read x and the weights as
stored. With the fused (K, 2, N) weight the two products' cotangents form one
(M, 2N) array, so d x is one matmul with a 2N-long K and d w one (K, 2N)
matmul; with separate weights d x is two matmuls summed in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from core.varying import cotangent_like
from pipelines import heuristic, kernel_call, operands
from pipelines.batching import batch_as_rows
from pipelines.config import MatmulDimension, TuningConfig, check_tuning_config
from pipelines.epilogue import Epilogue
from pipelines.matmul import operand_cotangents

# Each compute warpgroup holds a (64, 128) accumulator for each product: as
# many registers as the (64, 256) tile `matmul` takes on large problems, and
# the same loads per K step (a 128-row x tile and 256 weight columns).
BASE_CONFIG = TuningConfig(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=4,
                           wg_dimension=MatmulDimension.M)


def default_config(problem: operands.MatmulProblem, out_dtype) -> TuningConfig:
  """`BASE_CONFIG`, in 2-CTA clusters that multicast each weight tile to two
  row tiles where the clusters take no more waves than single CTAs, with the
  deepest pipeline up to its 4 stages whose SMEM fits beside the staging
  tile of an `out_dtype` output (a float32 one takes 3).

  Fitted on the forward of four model layers (llama3-8b at 8192 and 1024
  tokens, qwen2.5-7b at 8192, llama3-70b at 256) against six other configs
  (steps, epilogue tile, grid order, warpgroup split); checked on four held
  back (gemma2-9b at 8192, llama3.2-1b at 16384, qwen2.5-14b at 512,
  qwen2.5-32b at 2048): perf/2026-12-02-h200-gated-unit-configs.json.
  """
  config = BASE_CONFIG
  if heuristic.clusters_take_no_more_waves(BASE_CONFIG, problem):
    config = dataclasses.replace(config, cluster_m=2)
  padded = operands.pad_k(problem, config.tile_k)
  config = heuristic.deepest_fitting(
      config, range(config.max_concurrent_steps, 1, -1),
      lambda c: kernel_call.ws_smem_budget(c, padded, out_dtype, gated=True).fits())
  assert config is not None, "two stages of BASE_CONFIG's tiles always fit"
  return config


def gated_linear_unit(x: jax.Array, w_gate: jax.Array, w_up: jax.Array | None = None, *,
                      activation: str = "silu", out_dtype=None, transpose_rhs: bool = False,
                      config: TuningConfig | None = None) -> jax.Array:
  """`activation(x @ w_gate) * (x @ w_up)` on Hopper, in one kernel.

  Args:
    x: (..., K) float16 or bfloat16; leading dimensions are rows (M).
    w_gate: (K, N) of x's dtype, or (N, K) with `transpose_rhs`; or, with
      `w_up` None, the fused weight (K, 2, N) whose [:, 0] is the gate's and
      [:, 1] the up projection's (the layout tokamax's gated unit takes).
    w_up: stored as `w_gate` is, or None for a fused `w_gate`.
    activation: of the gate: "silu" (SwiGLU), "gelu" (tanh approximation,
      GeGLU), "relu" or "none" (bilinear).
    out_dtype: float16, bfloat16 or float32; x's dtype by default.
    transpose_rhs: separate weights stored (N, K), read as stored.
    config: a cooperative `TuningConfig` with k_splits = 1, whose warpgroups
      each hold two (tile_m, tile_n) accumulators; `default_config(...)` of
      the problem by default.

  Both products accumulate in float32 and the gating runs on the float32
  accumulators before the one cast to `out_dtype`. Gradients (`jax.grad`,
  `jax.vjp`, second order too): the differentiated forward also writes the
  two products in `out_dtype` (as a bf16 model keeps them); the activation's
  derivative is applied in float32, and the cotangents enter the backward
  matmuls in x's dtype. Forward-mode differentiation is not supported.

  Returns:
    (..., N) array of `out_dtype`. Under `jax.vmap`, a batched x with
    unbatched weights runs as one kernel over the stacked rows.
  """
  if x.ndim < 2:
    raise ValueError(f"x must be (..., K) with at least one row dimension, got {x.shape=}")
  fused = w_up is None
  if fused:
    if w_gate.ndim != 3 or w_gate.shape[1] != 2:
      raise ValueError(f"w_gate without w_up must be the fused (K, 2, N) weight, got "
                       f"{w_gate.shape=}")
    if transpose_rhs:
      raise ValueError("transpose_rhs applies to separate (N, K) weights, not a fused "
                       "(K, 2, N) one")
    k, _, n = w_gate.shape
    gate_shape = (k, n)
    weights = (w_gate.reshape(k, 2 * n),)
  else:
    for name, w in (("w_gate", w_gate), ("w_up", w_up)):
      if w.ndim != 2:
        raise ValueError(f"{name} must be 2-D ({'(N, K)' if transpose_rhs else '(K, N)'}), "
                         f"got {name}.shape={w.shape}")
    if (w_gate.shape, w_gate.dtype) != (w_up.shape, w_up.dtype):
      raise ValueError(f"w_gate and w_up must have one shape and dtype, got "
                       f"{w_gate.shape=} {w_gate.dtype}, {w_up.shape=} {w_up.dtype}")
    gate_shape = w_gate.shape
    n = w_gate.shape[0] if transpose_rhs else w_gate.shape[1]
    weights = (w_gate, w_up)
  rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
  layout = operands.OperandLayout(transpose_rhs=transpose_rhs)
  problem = operands.check_operands(rows, jax.ShapeDtypeStruct(gate_shape, w_gate.dtype), layout)
  out_dtype = operands.check_out_dtype(out_dtype, problem.dtype)
  Epilogue(activation=activation)  # Raises on an unknown activation.
  config = default_config(problem, out_dtype) if config is None else config
  check_tuning_config(config)
  kernel_call.check_ws_config(config, operands.pad_k(problem, config.tile_k), out_dtype,
                              gated=True)
  out = _make_differentiable(config, activation, out_dtype, layout, fused)(rows, *weights)
  return out.reshape(*x.shape[:-1], n)


@functools.cache
def _make_batchable(config: TuningConfig, activation: str, out_dtype,
                    layout: operands.OperandLayout, fused: bool, keep_products: bool):
  def run(x, *weights):
    gate, up = (weights[0], None) if fused else weights
    return kernel_call.ws_gated_matmul(x, gate, up, config=config, activation=activation,
                                       out_dtype=out_dtype, layout=layout,
                                       keep_products=keep_products)

  return batch_as_rows(run)


@functools.cache
def _make_differentiable(config: TuningConfig, activation: str, out_dtype,
                         layout: operands.OperandLayout, fused: bool):
  run = _make_batchable(config, activation, out_dtype, layout, fused, keep_products=False)
  keeping = _make_keeping_products(config, activation, out_dtype, layout, fused)
  epilogue = Epilogue(activation=activation)

  @jax.custom_vjp
  def differentiable(x, *weights):
    return run(x, *weights)

  def forward(x, *weights):
    # Through a custom_vjp, so that a second derivative reaches a rule too.
    out, gate_product, up_product = keeping(x, *weights)
    return out, (x, weights, gate_product, up_product)

  def backward(residuals, out_cotangent):
    return _backward(epilogue, layout, residuals, out_cotangent)

  differentiable.defvjp(forward, backward)
  return differentiable


@functools.cache
def _make_keeping_products(config: TuningConfig, activation: str, out_dtype,
                           layout: operands.OperandLayout, fused: bool):
  """(output, gate product, up product) from one kernel, differentiable in all three."""
  run = _make_batchable(config, activation, out_dtype, layout, fused, keep_products=True)
  epilogue = Epilogue(activation=activation)

  @jax.custom_vjp
  def keeping(x, *weights):
    return run(x, *weights)

  def forward(x, *weights):
    out, gate_product, up_product = keeping(x, *weights)
    return (out, gate_product, up_product), (x, weights, gate_product, up_product)

  def backward(residuals, cotangents):
    return _backward(epilogue, layout, residuals, *cotangents)

  keeping.defvjp(forward, backward)
  return keeping


def _backward(epilogue: Epilogue, layout: operands.OperandLayout, residuals, out_cotangent,
              gate_cotangent=None, up_cotangent=None):
  """(d x, *d weights) of out = act(gate) * up, from the kept products.

  d gate = g * up * act'(gate) and d up = g * act(gate), in float32 and in
  one XLA pass (with the products' own cotangents where they are outputs
  too), then cast to x's dtype for the backward matmuls.
  """
  x, weights, gate_product, up_product = residuals
  g = out_cotangent.astype(jnp.float32)
  gate = gate_product.astype(jnp.float32)
  d_gate = g * up_product.astype(jnp.float32) * epilogue.derivative(gate)
  d_up = g * epilogue.apply(gate)
  if gate_cotangent is not None:
    d_gate = d_gate + gate_cotangent.astype(jnp.float32)
    d_up = d_up + up_cotangent.astype(jnp.float32)
  if len(weights) == 1:
    # The fused (K, 2N) weight: one (M, 2N) cotangent, so d x and d w are a
    # matmul each.
    d_products = jnp.concatenate([d_gate, d_up], axis=1).astype(x.dtype)
    d_x, d_w = operand_cotangents(x, weights[0], d_products, layout)
    d_weights = (d_w,)
  else:
    (d_x_gate, d_w_gate), (d_x_up, d_w_up) = (
        operand_cotangents(x, w, d.astype(x.dtype), layout)
        for w, d in zip(weights, (d_gate, d_up), strict=True))
    d_x = (d_x_gate.astype(jnp.float32) + d_x_up.astype(jnp.float32)).astype(x.dtype)
    d_weights = (d_w_gate, d_w_up)
  return tuple(cotangent_like(ct, primal)
               for ct, primal in zip((d_x, *d_weights), (x, *weights), strict=True))
