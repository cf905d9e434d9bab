"""The public collective matmuls: validation, the logged choice of implementation, gradients.

    out = collectives.all_gather_matmul(x, w, "x")       # all_gather(x) @ w
    out = collectives.matmul_reduce_scatter(h, w, "x")   # reduce_scatter(h @ w)

Each is a `jax.custom_vjp` over the implementation its dispatcher chose
(`all_gather_matmul.py`, `matmul_reduce_scatter.py`), and each one's backward
pass is made of the other one and a local product:

  all_gather_matmul (out = all_gather(lhs) @ rhs):
    d lhs = matmul_reduce_scatter(g, rhs.T)
    d rhs = all_gather(lhs).T @ g
  matmul_reduce_scatter (out = reduce_scatter(lhs @ rhs)):
    d lhs = all_gather_matmul(g, rhs.T)
    d rhs = lhs.T @ all_gather(g)

The collective parts call the public functions with the forward's requested
implementation ("auto" decides again for the backward's shapes, "mosaic"
stays Mosaic, an XLA form its XLA counterpart), so the backward of the
Mosaic path runs the Mosaic kernels. The local products read the operands as
stored (`transpose_lhs`): `pipelines.matmul` behind the Mosaic kernels,
XLA's dot (`portable.xla_matmul`) behind the XLA forms, so those stay
portable. On one device ("local") both ops are `pipelines.matmul` and take
its gradient.

The all-gather in d rhs is done again in the backward pass (`lax.all_gather`
of the LHS shard), not saved from the forward ring: saving it would keep the
gathered (D * M_shard, K) activation of every layer alive until the backward
pass, D times what the layer's input holds, which is what sequence
parallelism exists to avoid; the re-gather costs one all-gather of the
shard, which has no dependence on the backward's reduce-scatter ring and can
overlap it (Megatron-LM's sequence parallelism makes the same choice). It is
also the same for every implementation: the Mosaic ring writes the received
shards to a scratch output in ring order, not gathered order.
"""

from __future__ import annotations

import functools
import logging

import jax
from jax import lax

# The package's names `all_gather_matmul` and `matmul_reduce_scatter` are the
# functions below, so the dispatch modules' names are imported from the modules.
from collectives import operands, portable, topology
from collectives.all_gather_matmul import choose_implementation as choose_all_gather
from collectives.all_gather_matmul import forward as all_gather_forward
from collectives.all_gather_matmul import parse_implementation as parse_all_gather
from collectives.dispatch import Choice, Implementation
from collectives.matmul_reduce_scatter import OP as REDUCE_SCATTER_OP
from collectives.matmul_reduce_scatter import choose_implementation as choose_reduce_scatter
from collectives.matmul_reduce_scatter import forward as reduce_scatter_forward
from core.varying import cotangent_like
from pipelines import TuningConfig, matmul

_log = logging.getLogger("collectives")

# The implementation the backward pass asks of the other op, by the forward's request.
_ALL_GATHER_TO_REDUCE_SCATTER = {
    Implementation.AUTO: Implementation.AUTO,
    Implementation.MOSAIC: Implementation.MOSAIC,
    Implementation.LOCAL: Implementation.LOCAL,
    Implementation.XLA_RING: Implementation.XLA_RING,
    Implementation.XLA_ALL_GATHER: Implementation.XLA_REDUCE_SCATTER,
}
_REDUCE_SCATTER_TO_ALL_GATHER = {v: k for k, v in _ALL_GATHER_TO_REDUCE_SCATTER.items()}


def _local_product(choice: Choice):
  """The backward's local matmul: the Mosaic kernel's behind Mosaic, XLA's behind XLA."""
  return matmul if choice.implementation == Implementation.MOSAIC else portable.xla_matmul


def all_gather_matmul(lhs: jax.Array, rhs: jax.Array, axis_name, *,
                      config: TuningConfig | None = None, dtype=None,
                      implementation: Implementation | str = Implementation.AUTO) -> jax.Array:
  """`all_gather(lhs, axis_name) @ rhs`, overlapping the gather with the matmul; inside `shard_map`.

  Args:
    lhs: (M_shard, K) float16 or bfloat16, this device's rows.
    rhs: (K, N_shard) of the same dtype, this device's columns.
    axis_name: the mesh axis the LHS is sharded over (D devices); the Mosaic
      kernel needs it to span all devices of the job.
    config: the ring kernel's matmul config; by default
      `ring_config.default_ring_config` for the local (M_shard, K, N_shard)
      problem: cooperative, no split K, a CTA tile that divides the shards
      (on one device, the plain matmul's tuning cache and heuristic). The
      backward pass picks its own configs.
    dtype: output dtype, float16 or bfloat16; the operand dtype by default.
    implementation: "auto", or one of "mosaic" (the ring kernel), "local"
      (one device only: the plain matmul), "xla_ring" (the ring of
      `ppermute`s) and "xla_all_gather" (`lax.all_gather`, then one dot) to
      force it. "auto" takes the Mosaic ring on Hopper GPUs that reach each
      other's memory when it has a config that tiles the shards; otherwise the
      all-gather + dot on GPUs and the XLA ring elsewhere, and logs why. Only
      "mosaic" raises NotImplementedError where it cannot run.

  Gradients (`jax.grad`): d lhs = `matmul_reduce_scatter(g, rhs.T)`, d rhs =
  `all_gather(lhs).T @ g` with the LHS gathered again in the backward pass
  (memory-light; see the module docstring). "mosaic" runs the Mosaic
  reduce-scatter ring in the backward and refuses where it cannot.

  Returns:
    (D * M_shard, N_shard) of `dtype`; row block j is `lhs_j @ rhs`.
  """
  num_devices = topology.ring_axis_size(axis_name, span_all_devices=False)
  problem, out_dtype = operands.check_shards(lhs, rhs, dtype, config)
  requested = parse_all_gather(implementation)
  choice = choose_all_gather(num_devices, requested, problem=problem, out_dtype=out_dtype,
                              config=config)
  _log.debug("all_gather_matmul over %d devices of %s: %s (%s)", num_devices, axis_name,
             choice.implementation.value, choice.reason)
  if choice.implementation == Implementation.LOCAL:
    return matmul(lhs, rhs, config=config, out_dtype=out_dtype)  # With matmul's own VJP.
  return _differentiable_all_gather_matmul(axis_name, num_devices, choice, requested, config,
                                           out_dtype)(lhs, rhs)


@functools.cache
def _differentiable_all_gather_matmul(axis_name, num_devices: int, choice: Choice,
                                      requested: Implementation, config, out_dtype):
  @jax.custom_vjp
  def differentiable(lhs, rhs):
    return all_gather_forward(choice, lhs, rhs, axis_name, num_devices=num_devices, config=config,
                              out_dtype=out_dtype)

  def forward(lhs, rhs):
    # Through the custom_vjp, so that a second derivative reaches this rule again.
    return differentiable(lhs, rhs), (lhs, rhs)

  def backward(residuals, g):
    lhs, rhs = residuals
    g = g.astype(lhs.dtype)
    d_lhs = matmul_reduce_scatter(g, rhs.T, axis_name, dtype=lhs.dtype,
                                  implementation=_ALL_GATHER_TO_REDUCE_SCATTER[requested])
    # Gathered again rather than saved by the forward pass: see the module docstring.
    gathered = lax.all_gather(lhs, axis_name, axis=0, tiled=True)
    d_rhs = _local_product(choice)(gathered, g, transpose_lhs=True, out_dtype=rhs.dtype)
    return cotangent_like(d_lhs, lhs), cotangent_like(d_rhs, rhs)

  differentiable.defvjp(forward, backward)
  return differentiable


def matmul_reduce_scatter(lhs: jax.Array, rhs: jax.Array, axis_name, *,
                          config: TuningConfig | None = None, dtype=None,
                          implementation: Implementation | str = Implementation.AUTO
                          ) -> jax.Array:
  """`psum_scatter(lhs @ rhs, axis_name)` rows, overlapping the reduction with the matmul;
  inside `shard_map`.

  Args:
    lhs: (M, K_shard) float16 or bfloat16, this device's columns of the LHS;
      M divisible by D.
    rhs: (K_shard, N) of the same dtype, this device's rows of the RHS.
    axis_name: the mesh axis K is sharded over (D devices).
    config: the Mosaic ring kernel's config for one row block's problem
      (M / D, K_shard, N); by default the kernel's own choice (on one device,
      the plain matmul's tuning cache and heuristic). The backward pass picks
      its own configs.
    dtype: output dtype, float16 or bfloat16; the operand dtype by default.
    implementation: "auto", or one of "mosaic" (the Mosaic ring kernel),
      "local" (one device only: the plain matmul), "xla_ring" (a ring of
      `ppermute`s of float32 partial sums) and "xla_reduce_scatter" (one dot,
      then `lax.psum_scatter`) to force it. "auto" takes the Mosaic ring where
      it runs and has a config; otherwise the dot + reduce-scatter on GPUs and
      the XLA ring elsewhere, and logs why. Only "mosaic" raises
      NotImplementedError where it cannot run.

  Gradients (`jax.grad`): d lhs = `all_gather_matmul(g, rhs.T)`, d rhs =
  `lhs.T @ all_gather(g)` (the cotangent gathered once more for it).

  Returns:
    (M / D, N) of `dtype`: row block d of the sum over devices of
    `lhs_i @ rhs_i`, accumulated in float32 (the Mosaic ring sends its
    partial sums in `dtype` on 2 devices, in float32 on more).

  Raises:
    ValueError: M not divisible by D, or operands `pipelines.matmul` refuses.
  """
  num_devices = topology.ring_axis_size(axis_name, span_all_devices=False)
  block, out_dtype = operands.check_reduce_scatter_operands(lhs, rhs, dtype, num_devices,
                                                            config)
  requested = REDUCE_SCATTER_OP.parse(implementation)
  choice = choose_reduce_scatter(num_devices, requested, problem=block, out_dtype=out_dtype,
                                 config=config)
  _log.debug("matmul_reduce_scatter over %d devices of %s: %s (%s)", num_devices, axis_name,
             choice.implementation.value, choice.reason)
  if choice.implementation == Implementation.LOCAL:
    return matmul(lhs, rhs, config=config, out_dtype=out_dtype)  # With matmul's own VJP.
  return _differentiable_matmul_reduce_scatter(axis_name, num_devices, choice, requested,
                                               config, out_dtype)(lhs, rhs)


@functools.cache
def _differentiable_matmul_reduce_scatter(axis_name, num_devices: int, choice: Choice,
                                          requested: Implementation, config, out_dtype):
  @jax.custom_vjp
  def differentiable(lhs, rhs):
    return reduce_scatter_forward(choice, lhs, rhs, axis_name, num_devices=num_devices,
                                  config=config, out_dtype=out_dtype)

  def forward(lhs, rhs):
    return differentiable(lhs, rhs), (lhs, rhs)

  def backward(residuals, g):
    lhs, rhs = residuals
    g = g.astype(lhs.dtype)
    d_lhs = all_gather_matmul(g, rhs.T, axis_name, dtype=lhs.dtype,
                              implementation=_REDUCE_SCATTER_TO_ALL_GATHER[requested])
    gathered = lax.all_gather(g, axis_name, axis=0, tiled=True)
    d_rhs = _local_product(choice)(lhs, gathered, transpose_lhs=True, out_dtype=rhs.dtype)
    return cotangent_like(d_lhs, lhs), cotangent_like(d_rhs, rhs)

  differentiable.defvjp(forward, backward)
  return differentiable


__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]
