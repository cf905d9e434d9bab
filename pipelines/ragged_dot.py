"""`ragged_dot`: the grouped matmul of mixture-of-experts layers, on the warp-specialized kernel.

`jax.lax.ragged_dot(lhs (M, K), rhs (G, K, N), group_sizes (G,))` multiplies
the rows of group g (consecutive, in order) by rhs[g]: each expert's tokens
by that expert's weights, after a router sorted the tokens by expert. Here
it is one persistent kernel (`kernel_call.ws_ragged_matmul`) whose work
items are (row tile, N tile) pairs of a table laid out on the device from
the group sizes (`group_schedule`): no tile mixes two groups' weights, and a
new routing needs no new kernel.

Gradients (`jax.custom_vjp`): d lhs is the grouped matmul of the cotangent
with each weight read transposed as stored, on the same kernel; d rhs, the
per-group `lhs_g.T @ g_g`, is the same kernel with a ragged K
(`kernel_call.ws_ragged_k_matmul`): each (group, weight tile) work item runs
its K loop over its group's rows only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from core.varying import cotangent_like
from pipelines import heuristic, kernel_call, operands
from pipelines.batching import refusing_gradient
from pipelines.config import MatmulDimension, TuningConfig, check_tuning_config
from pipelines.epilogue import PARTIAL_ROWS_BYTES, Epilogue

# Its custom_vjp's rules call kernels directly, so only the first derivative exists.
_NO_SECOND_ORDER = ("ragged_dot is differentiable once: its gradient is not differentiable "
                    "again (no grad of grad)")


def default_config(problem: operands.MatmulProblem, out_dtype, *,
                   ragged_k: bool = False) -> TuningConfig:
  """The heuristic's cooperative config for the dense problem of all M rows
  (the grouped kernels run no other schedule), made one they run: one CTA
  per cluster (a cluster's two row tiles could be on two groups' weights), no
  split of K, epilogue tiles at least as wide as one chunk of the rows at a
  group's edge (the dense heuristic's tile for decode-size M and N <= 64 has
  narrower ones); then the deepest pipeline whose SMEM fits beside the
  grouped epilogue's staging tiles.

  With `ragged_k`, for the weight gradient (`kernel_call.ws_ragged_k_matmul`):
  `problem` is its dense (K, all M rows, N) TN product, and the warpgroups
  split the output's rows (each zeroes the other groups' rows in its own
  LHS columns)."""
  config = dataclasses.replace(heuristic.default_config(problem, out_dtype, grouped=True),
                               k_splits=1, cluster_m=1)
  if ragged_k:
    config = dataclasses.replace(config, wg_dimension=MatmulDimension.M)
  else:
    chunk = PARTIAL_ROWS_BYTES // jnp.dtype(out_dtype).itemsize
    if config.epi_tile_n % chunk:
      epi_tile_n = operands.round_up(config.epi_tile_n, chunk)
      config = dataclasses.replace(config, epi_tile_n=epi_tile_n, rhs_tile_n=None,
                                   tile_n=operands.round_up(config.tile_n, epi_tile_n))
  padded = operands.pad_k(problem, config.tile_k)

  def fits(candidate: TuningConfig) -> bool:
    try:
      kernel_call.check_ws_config(candidate, padded, out_dtype, grouped=not ragged_k,
                                  ragged_k=ragged_k)
    except ValueError:
      return False
    return True

  deepest = heuristic.deepest_fitting(config, range(config.max_concurrent_steps, 1, -1), fits)
  return config if deepest is None else deepest  # The config's error names what does not fit.


def weight_gradient(lhs: jax.Array, g: jax.Array, group_sizes: jax.Array,
                    out_dtype) -> jax.Array:
  """(G, K, N) = lhs[rows of g].T @ g[rows of g] per group, for lhs (M, K) and g (M, N):
  `ragged_dot`'s d rhs, on `kernel_call.ws_ragged_k_matmul` with `default_config`."""
  layout = operands.OperandLayout(transpose_lhs=True)
  problem = operands.check_operands(lhs, g, layout)
  config = default_config(problem, out_dtype, ragged_k=True)
  return refusing_gradient(
      functools.partial(kernel_call.ws_ragged_k_matmul, config=config, out_dtype=out_dtype),
      _NO_SECOND_ORDER)(lhs, g, group_sizes)


def _check_group_sizes(group_sizes, num_groups: int, m: int) -> None:
  if not hasattr(group_sizes, "dtype") or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be an integer array of shape (G,)=({num_groups},), got "
                     f"{getattr(group_sizes, 'dtype', type(group_sizes).__name__)}")
  if group_sizes.shape != (num_groups,):
    raise ValueError(f"group_sizes must have shape (G,)=({num_groups},) (one size per group of "
                     f"rhs), got {group_sizes.shape}")
  if isinstance(group_sizes, jax.core.Tracer):
    return  # Traced sizes are data: see ragged_dot's docstring.
  sizes = np.asarray(group_sizes)
  if (sizes < 0).any():
    raise ValueError(f"group_sizes must not be negative, got {sizes.tolist()}")
  if sizes.sum() > m:
    raise ValueError(f"group_sizes sum to {int(sizes.sum())}, more than the M={m} rows of lhs")


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
               activation: str = "none", out_dtype=None, transpose_rhs: bool = False,
               config: TuningConfig | None = None) -> jax.Array:
  """`activation(jax.lax.ragged_dot(lhs, rhs, group_sizes))` on Hopper, in one kernel.

  Args:
    lhs: (M, K) float16 or bfloat16; its rows are grouped in order, group g
      holding `group_sizes[g]` of them.
    rhs: (G, K, N) of lhs's dtype, one weight per group; or (G, N, K) with
      `transpose_rhs` (read as stored, no transpose in HBM).
    group_sizes: (G,) integers. Rows past their sum give zeros. Known sizes
      (not traced) must be non-negative and sum to at most M, else a
      ValueError; traced ones are data read on the device (a new routing
      compiles nothing), where negative sizes count as 0 and rows past M
      are dropped from the last groups.
    activation: "none", "relu", "gelu" (tanh approximation) or "silu",
      applied to the float32 product before the one cast.
    out_dtype: float16, bfloat16 or float32; lhs's dtype by default.
    transpose_rhs: whether each weight is stored (N, K).
    config: a cooperative `TuningConfig` with k_splits = 1 and cluster_m = 1;
      `default_config(...)` of the dense problem by default.

  Any M, K, N and G work, empty groups and one group holding every row
  included; M, N or K of 0 give what `jax.lax.ragged_dot` gives. Gradients
  (`jax.grad`, `jax.vjp`): d lhs is this kernel on the cotangent and the
  weights as stored; d rhs is this kernel with a ragged K (each group's
  `lhs.T @ cotangent` over its rows, read as stored); an activation's
  derivative multiplies the cotangent in float32, written by the
  differentiated forward's epilogue in `out_dtype`. In d rhs a non-finite
  value in `lhs` or the cotangent may reach the gradient of the
  neighbouring group (the kernel zeroes the other groups' rows of only one
  operand).

  Returns:
    (M, N) array of `out_dtype`, accumulated in float32.
  """
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be 2-D (M, K), got lhs.shape={lhs.shape}")
  if rhs.ndim != 3:
    raise ValueError(f"rhs must be 3-D ({'(G, N, K)' if transpose_rhs else '(G, K, N)'}), got "
                     f"rhs.shape={rhs.shape}")
  _check_group_sizes(group_sizes, rhs.shape[0], lhs.shape[0])
  layout = operands.OperandLayout(transpose_rhs=transpose_rhs)
  problem = operands.check_operands(lhs, jax.ShapeDtypeStruct(rhs.shape[1:], rhs.dtype), layout)
  out_dtype = operands.check_out_dtype(out_dtype, problem.dtype)
  epilogue = Epilogue(activation=activation)
  if config is None:
    config = default_config(problem, out_dtype)
  check_tuning_config(config)
  kernel_call.check_ws_config(config, operands.pad_k(problem, config.tile_k), out_dtype,
                              grouped=True)
  return _make_differentiable(config, epilogue, out_dtype, transpose_rhs)(
      lhs, rhs, group_sizes.astype(jnp.int32))


@functools.cache
def _make_differentiable(config: TuningConfig, epilogue: Epilogue, out_dtype,
                         transpose_rhs: bool):
  def run(lhs, rhs, group_sizes, keep_derivative=False):
    return refusing_gradient(
        functools.partial(kernel_call.ws_ragged_matmul, config=config, epilogue=epilogue,
                          out_dtype=out_dtype, transpose_rhs=transpose_rhs,
                          keep_derivative=keep_derivative),
        _NO_SECOND_ORDER)(lhs, rhs, group_sizes)

  @jax.custom_vjp
  def differentiable(lhs, rhs, group_sizes):
    return run(lhs, rhs, group_sizes)

  def forward(lhs, rhs, group_sizes):
    if epilogue.keeps_derivative:
      # gelu's and silu's derivatives need the pre-activation: the epilogue
      # writes the derivative beside the output instead of a second grouped
      # matmul recomputing the pre-activation.
      out, saved = run(lhs, rhs, group_sizes, keep_derivative=True)
    else:
      out = run(lhs, rhs, group_sizes)
      saved = out if epilogue.activation == "relu" else None
    return out, (lhs, rhs, group_sizes, saved)

  def backward(residuals, out_cotangent):
    lhs, rhs, group_sizes, saved = residuals
    g = epilogue.sum_cotangent(out_cotangent, saved).astype(lhs.dtype)
    # d lhs = g @ rhs[group].T: the grouped matmul with each weight read
    # transposed, as stored.
    d_lhs = ragged_dot(g, rhs, group_sizes, transpose_rhs=not transpose_rhs,
                       out_dtype=lhs.dtype)
    # d rhs[g] = lhs_g.T @ g_g, or for weights stored (N, K) its transpose
    # g_g.T @ lhs_g: both read their operands as stored.
    d_rhs = (weight_gradient(g, lhs, group_sizes, rhs.dtype) if transpose_rhs
             else weight_gradient(lhs, g, group_sizes, rhs.dtype))
    return (cotangent_like(d_lhs, lhs), cotangent_like(d_rhs, rhs), None)

  differentiable.defvjp(forward, backward)
  return differentiable
