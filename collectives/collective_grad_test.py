"""Gradients of both collective matmuls, every implementation, against `jax.grad` of the
plain XLA formulation (all_gather + dot, dot + psum_scatter) in float32.

On 2 and 4 simulated CPU devices (1 for "local"), inside `jax.shard_map` with
varying types checked. "mosaic" runs with the ring kernels replaced by XLA
stand-ins that record their calls (the ring kernels themselves are tested in
`ring_matmul_multi_gpu_test.py`), to check that the backward pass of the
Mosaic path calls the Mosaic kernels; its local product is the real
`pipelines.matmul` (interpret mode on CPU).
"""

import functools
import importlib
import types
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized
from jax import lax

import collectives
import simulator
from collectives import (
  portable,
  ring_matmul_sm90,
  ring_reduce_scatter_sm90,
  sharding,
  topology,
)
from core import testing
from pipelines import MatmulDimension, TuningConfig

# The dispatch module: the package's name `matmul_reduce_scatter` is the function.
reduce_scatter_module = importlib.import_module("collectives.matmul_reduce_scatter")

# XLA sizes its CPU thread pool when jax starts the CPU backend, which no
# import above does: size it for the simulated devices' kernels.
simulator.reserve_intra_op_threads()

SUPPORTED = topology.RingSupport(True, "one process drives all GPUs (mocked)")
KERNEL_CONFIG = TuningConfig(tile_m=64, tile_n=64, wg_dimension=MatmulDimension.M)
ALL_GATHER_IMPLEMENTATIONS = ("auto", "xla_ring", "xla_all_gather", "mosaic")
REDUCE_SCATTER_IMPLEMENTATIONS = ("auto", "xla_ring", "xla_reduce_scatter", "mosaic")
# Captured before any test wraps them: the stand-ins for the Mosaic kernels.
ALL_GATHER_STAND_IN = portable.all_gather_then_matmul
REDUCE_SCATTER_STAND_IN = portable.xla_ring_matmul_reduce_scatter


def plain_all_gather_matmul(lhs, rhs, axis_name):
  gathered = lax.all_gather(lhs, axis_name, axis=0, tiled=True)
  return jnp.dot(gathered, rhs, precision=lax.Precision.HIGHEST)


def plain_matmul_reduce_scatter(lhs, rhs, axis_name):
  partial = jnp.dot(lhs, rhs, precision=lax.Precision.HIGHEST)
  return lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True)


def weighted_loss(per_device, mesh, layout, weights):
  """sum(out * weights) of `per_device(lhs, rhs, axis)` under shard_map: every output
  element gets its own cotangent."""
  run = jax.shard_map(functools.partial(per_device, axis_name=sharding.RING_AXIS), mesh=mesh,
                      in_specs=(layout.lhs, layout.rhs), out_specs=layout.out)

  def loss(lhs, rhs):
    return jnp.sum(run(lhs, rhs).astype(jnp.float32) * weights)

  return loss


class CollectiveGradTest(testing.KernelTestCase):

  def setUp(self):
    super().setUp()
    self.all_gather_kernel_calls = []
    self.reduce_scatter_kernel_calls = []

  def mock_mosaic_kernels(self):
    """Both ring kernels replaced by recording XLA stand-ins, and said to run here."""
    def all_gather_kernel(lhs, rhs, axis_name, *, config, dtype):
      self.all_gather_kernel_calls.append(config)
      return ALL_GATHER_STAND_IN(lhs, rhs, axis_name, dtype=dtype)

    def reduce_scatter_kernel(lhs, rhs, axis_name, *, config, dtype=None):
      self.reduce_scatter_kernel_calls.append(config)
      return REDUCE_SCATTER_STAND_IN(lhs, rhs, axis_name, dtype=dtype)

    kernel = types.SimpleNamespace(ring_matmul_reduce_scatter=reduce_scatter_kernel,
                                   ring_reduce_scatter_config=lambda *_: KERNEL_CONFIG,
                                   check_reduce_scatter_config=lambda *_: None)
    self.enter_context(mock.patch.object(ring_matmul_sm90, "all_gather_lhs_matmul",
                                         side_effect=all_gather_kernel))
    self.enter_context(mock.patch.object(reduce_scatter_module, "ring_kernel",
                                         return_value=kernel))
    self.enter_context(mock.patch.object(topology, "mosaic_ring_support",
                                         return_value=SUPPORTED))
    if self.backend == testing.INTERPRET:
      # `pipelines.matmul` on several simulated devices at once (the local product).
      self.enter_context(simulator.collective_interpret_mode(wait_timeout_s=60))

  def check_grads(self, op, plain, layout, d, lhs_shape, rhs_shape, out_shape, *, seed,
                  dtype=jnp.bfloat16, **kwargs):
    if d > jax.device_count():
      self.skipTest(f"needs {d} devices, the job has {jax.device_count()}")
    mesh = sharding.ring_mesh(d)
    lhs = testing.random_array(seed, lhs_shape, dtype)
    rhs = testing.random_array(seed + 1, rhs_shape, dtype)
    weights = testing.random_array(seed + 2, out_shape, jnp.float32)
    loss = weighted_loss(functools.partial(op, **kwargs), mesh, layout, weights)
    reference = weighted_loss(plain, mesh, layout, weights)
    placed = sharding.place_operands(lhs, rhs, mesh, layout)
    grads = self.run_kernel(jax.jit(jax.grad(loss, argnums=(0, 1))), *placed)
    f32 = sharding.place_operands(lhs.astype(jnp.float32), rhs.astype(jnp.float32), mesh, layout)
    expected = jax.jit(jax.grad(reference, argnums=(0, 1)))(*f32)
    for name, got, want, primal in zip(("lhs", "rhs"), grads, expected, (lhs, rhs), strict=True):
      with self.subTest(cotangent=name):
        self.assertEqual((got.shape, got.dtype), (primal.shape, primal.dtype))
        self.assert_close(got, want, dtype=dtype)

  def check_all_gather_matmul(self, d, implementation, *, seed, m_shard=64, k=64, n_shard=128,
                              **kwargs):
    self.check_grads(collectives.all_gather_matmul, plain_all_gather_matmul, sharding.ALL_GATHER,
                     d, (d * m_shard, k), (k, d * n_shard), (d * m_shard, d * n_shard),
                     seed=seed, implementation=implementation, **kwargs)

  def check_matmul_reduce_scatter(self, d, implementation, *, seed, m=None, k_shard=128, n=64,
                                  **kwargs):
    m = m or 64 * d
    self.check_grads(collectives.matmul_reduce_scatter, plain_matmul_reduce_scatter,
                     sharding.REDUCE_SCATTER, d, (m, d * k_shard), (d * k_shard, n), (m, n),
                     seed=seed, implementation=implementation, **kwargs)

  @parameterized.product(d=[2, 4], implementation=ALL_GATHER_IMPLEMENTATIONS)
  def test_all_gather_matmul(self, d, implementation):
    if implementation == "mosaic":
      self.mock_mosaic_kernels()
    self.check_all_gather_matmul(d, implementation, seed=100 + d)
    if implementation == "mosaic":
      # Forward: the all-gather ring; backward: d lhs on the reduce-scatter ring.
      self.assertLen(self.all_gather_kernel_calls, 1)
      self.assertEqual(self.reduce_scatter_kernel_calls, [KERNEL_CONFIG])

  @parameterized.product(d=[2, 4], implementation=REDUCE_SCATTER_IMPLEMENTATIONS)
  def test_matmul_reduce_scatter(self, d, implementation):
    if implementation == "mosaic":
      self.mock_mosaic_kernels()
    self.check_matmul_reduce_scatter(d, implementation, seed=200 + d)
    if implementation == "mosaic":
      self.assertEqual(self.reduce_scatter_kernel_calls, [KERNEL_CONFIG])
      self.assertLen(self.all_gather_kernel_calls, 1)

  def test_local_on_one_device(self):
    """One device: both ops are `pipelines.matmul`, with its gradient."""
    self.check_all_gather_matmul(1, "local", seed=300, m_shard=64)
    self.check_matmul_reduce_scatter(1, "local", seed=310)

  @parameterized.parameters("xla_ring", "mosaic")
  def test_output_dtype_other_than_the_operands(self, implementation):
    """A float16 output of bfloat16 operands: the cotangent enters the backward in bfloat16."""
    if implementation == "mosaic":
      self.mock_mosaic_kernels()
    self.check_all_gather_matmul(2, implementation, seed=400, dtype=jnp.bfloat16)
    self.check_matmul_reduce_scatter(2, implementation, seed=410, dtype=jnp.bfloat16)
    self.check_all_gather_matmul(4, implementation, seed=420, dtype=jnp.float16)

  @parameterized.parameters("all_gather", "reduce_scatter")
  def test_mosaic_ring_kernels_forward_and_backward(self, op):
    """The real ring kernels, not stand-ins, in a type-checked shard_map: simulated
    devices on CPU, with race detection. The backward of each op runs the other
    op's kernel."""
    if self.backend == testing.INTERPRET:
      self.enter_context(mock.patch.object(topology, "mosaic_ring_support",
                                           return_value=SUPPORTED))
      self.enter_context(simulator.collective_interpret_mode(wait_timeout_s=120))
    if op == "all_gather":
      self.check_all_gather_matmul(2, "mosaic", seed=500, m_shard=128, k=128, n_shard=128)
    else:
      self.check_matmul_reduce_scatter(2, "mosaic", seed=510, m=256, k_shard=128, n=128)

  @parameterized.parameters("all_gather", "reduce_scatter")
  def test_mosaic_kernel_results_vary_over_the_ring_axis(self, op):
    """The real ring kernels' results are typed as varying over the ring axis inside a
    type-checked shard_map (the stand-ins above are XLA, typed by JAX). Typed as
    the same on every device, as Mosaic GPU types every kernel result, they made
    `jax.grad` sum the devices' cotangents: relative error 1.0 on 2 GPUs."""
    mesh = sharding.ring_mesh(jax.device_count())
    d = mesh.size
    if op == "all_gather":
      kernel, layout = ring_matmul_sm90.all_gather_lhs_matmul, sharding.ALL_GATHER
      lhs, rhs = (d * 128, 128), (128, d * 128)
    else:
      kernel, layout = ring_reduce_scatter_sm90.ring_matmul_reduce_scatter, sharding.REDUCE_SCATTER
      lhs, rhs = (d * 128, d * 128), (d * 128, 128)
    seen = []

    def per_device(a, b):
      out = kernel(a, b, sharding.RING_AXIS, config=KERNEL_CONFIG)
      seen.append(jax.typeof(out).manual_axis_type.varying)
      return out

    run = jax.shard_map(per_device, mesh=mesh, in_specs=(layout.lhs, layout.rhs),
                        out_specs=layout.out)
    jax.eval_shape(run, *sharding.abstract_operands(jax.ShapeDtypeStruct(lhs, jnp.bfloat16),
                                                    jax.ShapeDtypeStruct(rhs, jnp.bfloat16),
                                                    mesh, layout))
    self.assertEqual(seen, [frozenset({sharding.RING_AXIS})])


if __name__ == "__main__":
  absltest.main()
