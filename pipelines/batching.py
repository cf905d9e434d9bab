"""Transformation rules for a matmul kernel call, which has none of its own.

`jax.vmap`: a batch of LHS rows is one bigger matmul. The matmuls share one
batching rule, through `jax.custom_batching.custom_vmap`: where only the
(M, K) LHS is batched, its batch is stacked into M (a free reshape) and one
kernel runs; any other batching loops over the batch with `lax.map`, one
kernel per element.

`jax.grad` of an op that is not differentiable (an FP8 product): an error
that names the op and what to use instead, where the kernel call alone
fails with "Differentiation rule for 'mpmd_map' not implemented".
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import custom_batching


def batch_as_rows(run: Callable, *, lhs_rows_leading: bool = True) -> Callable:
  """`run(lhs, *rest)` (a kernel call on a 2-D LHS and other arrays or None)
  with the vmap rule above.

  Args:
    run: returns an array, or a tuple of arrays, each (M, ...) with one row
      per LHS row.
    lhs_rows_leading: whether the LHS is stored (M, K), so that a batch of
      LHS arrays stacks into (B * M, K); False for a (K, M) LHS.
  """
  batchable = custom_batching.custom_vmap(run)

  @batchable.def_vmap
  def _vmap_rule(axis_size, in_batched, lhs, *rest):
    lhs_batched, *rest_batched = in_batched
    if lhs_batched and not any(rest_batched) and lhs_rows_leading:
      # One matmul over the stacked rows keeps a single kernel launch.
      batch, m, k = lhs.shape
      outs = batchable(lhs.reshape(batch * m, k), *rest)
      outs = jax.tree.map(lambda out: out.reshape(batch, m, *out.shape[1:]), outs)
    else:
      def broadcast(x, batched):
        return x if x is None or batched else jnp.broadcast_to(x, (axis_size, *x.shape))
      args = tuple(broadcast(x, b) for x, b in zip((lhs, *rest), in_batched, strict=True))
      outs = jax.lax.map(lambda xs: batchable(*xs), args)
    return outs, jax.tree.map(lambda _: True, outs)

  return batchable


def refusing_gradient(run: Callable, message: str) -> Callable:
  """`run(*arrays)` (arrays or None), whose gradient raises TypeError(message)."""

  @jax.custom_vjp
  def call(*args):
    return run(*args)

  def forward(*args):
    return call(*args), None

  def backward(residuals, cotangents):
    del residuals, cotangents
    raise TypeError(message)

  call.defvjp(forward, backward)
  return call
