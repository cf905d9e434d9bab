"""`matmul`: the library's public matmul, backed by the warp-specialized kernel.

It validates the operands, picks a config (explicit, from the tuning cache, or
the heuristic in `heuristic.py`), and supports `jax.jit`, `jax.vmap` and use
inside `jax.shard_map` (per-device shapes). The kernel call itself is
`kernel_call.ws_matmul`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import custom_batching

from pipelines import kernel_call, operands, tuning_cache
from pipelines.config import TuningConfig
from pipelines.epilogue import Epilogue
from pipelines.heuristic import default_config

CACHE_MISS_MODES = ("heuristic", "tune", "error")

def choose_config(problem: operands.MatmulProblem, out_dtype, *,
                  on_cache_miss: str = "heuristic", lhs=None, rhs=None) -> TuningConfig:
  """The cached config for `problem`, or what `on_cache_miss` says to do."""
  if on_cache_miss not in CACHE_MISS_MODES:
    raise ValueError(f"on_cache_miss={on_cache_miss!r} must be one of {CACHE_MISS_MODES}")
  cached = tuning_cache.lookup(problem, out_dtype)
  if cached is not None:
    return cached
  match on_cache_miss:
    case "error":
      raise LookupError(f"no tuned config for {tuning_cache.cache_key(problem, out_dtype)}; "
                        "run //tools:autotune_matmul for this shape")
    case "tune":
      from pipelines import autotune  # noqa: PLC0415 - only needed on this path.
      return autotune.tune(lhs, rhs, out_dtype=out_dtype, store=True).best.config
  return default_config(problem, out_dtype)


def matmul(lhs: jax.Array, rhs: jax.Array, bias: jax.Array | None = None, *,
           activation: str = "none", out_dtype=None, config: TuningConfig | None = None,
           on_cache_miss: str = "heuristic") -> jax.Array:
  """`activation(lhs @ rhs + bias)` on Hopper, fused in one kernel.

  Args:
    lhs: (M, K) float16 or bfloat16. M is arbitrary (edge tiles are masked).
    rhs: (K, N), same dtype. N a multiple of 8; K a multiple of 16.
    bias: optional (N,), added in float32 before the activation.
    activation: "none", "relu", "gelu" (tanh approximation) or "silu".
    out_dtype: float16, bfloat16 or float32; the operand dtype by default.
    config: a `TuningConfig`; by default the tuning cache's entry for this
      GPU, jax version and shape, else what `on_cache_miss` says:
      "heuristic" (default), "tune" (sweep now, on a GPU) or "error".

  K need not be a multiple of the config's tile_k: it is zero-padded to one
  (a copy of both operands; the heuristic's tile_k is 64). Where M, N or K
  is 0 no kernel runs and the result is what `jnp.dot` gives: an empty
  array, or for K = 0 `activation(bias)` (zeros without a bias).

  Returns:
    (M, N) array of `out_dtype`. Under `jax.vmap`, a batched `lhs` with an
    unbatched `rhs` runs as one (B*M, K) matmul; other batchings loop.
  """
  problem = operands.check_operands(lhs, rhs)
  out_dtype = operands.check_out_dtype(out_dtype, problem.dtype)
  if config is None and problem.is_empty:
    # Nothing to tune or launch: `ws_matmul` returns without a kernel.
    config = default_config(problem, out_dtype)
  if config is None:
    config = choose_config(problem, out_dtype, on_cache_miss=on_cache_miss, lhs=lhs, rhs=rhs)
  epilogue = Epilogue(activation=activation, has_bias=bias is not None)
  return _make_batchable(config, epilogue, out_dtype)(lhs, rhs, bias)


@functools.cache
def _make_batchable(config: TuningConfig, epilogue: Epilogue, out_dtype):
  @custom_batching.custom_vmap
  def run(lhs, rhs, bias):
    return kernel_call.ws_matmul(lhs, rhs, bias, config=config, epilogue=epilogue,
                                    out_dtype=out_dtype)

  @run.def_vmap
  def _vmap_rule(axis_size, in_batched, lhs, rhs, bias):
    lhs_b, rhs_b, bias_b = in_batched
    if lhs_b and not rhs_b and not bias_b:
      # One matmul over the stacked rows keeps a single kernel launch.
      batch, m, k = lhs.shape
      out = run(lhs.reshape(batch * m, k), rhs, bias)
      return out.reshape(batch, m, -1), True
    lhs = lhs if lhs_b else jnp.broadcast_to(lhs, (axis_size, *lhs.shape))
    rhs = rhs if rhs_b else jnp.broadcast_to(rhs, (axis_size, *rhs.shape))
    if bias is not None and not bias_b:
      bias = jnp.broadcast_to(bias, (axis_size, *bias.shape))
    return jax.lax.map(lambda xs: run(*xs), (lhs, rhs, bias)), True

  return run
