"""Mesh-axis types of Mosaic GPU kernel results inside `jax.shard_map`.

Inside `jax.shard_map` every value says over which manual mesh axes it
varies, and JAX differentiates by those types: where a value typed as the
same on every device meets one that varies (an `out_specs` that shards it, a
sum with a sharded bias), JAX inserts a broadcast whose transpose sums the
cotangent over the devices. Mosaic GPU kernels (`plgpu.kernel`,
`pl.pallas_call`) type every result as the same on every device, whatever
their inputs, so a matmul of sharded operands looked replicated: on 2 GPUs,
`jax.grad` through it summed the devices' cotangents and returned wrong
gradients (relative error 1.0) without an error. Every kernel wrapper of
this repo therefore returns its results through `varying_kernel`, and the
backward passes type their cotangents with `cotangent_like`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax


def varying_axes(values: Iterable) -> frozenset:
  """The manual mesh axes any of `values` (arrays; others are skipped) varies over."""
  axes = frozenset()
  for value in values:
    if isinstance(value, jax.Array):  # Tracers included.
      axes |= jax.typeof(value).manual_axis_type.varying
  return axes


def vary_over(value, axes: Iterable):
  """`value`, typed as varying over `axes` as well (a no-op outside `jax.shard_map` and
  where it already does)."""
  missing = tuple(sorted(frozenset(axes) - jax.typeof(value).manual_axis_type.varying))
  return jax.lax.pcast(value, missing, to="varying") if missing else value


def cotangent_like(cotangent, primal):
  """`cotangent` typed as `primal` is, for a custom VJP's backward pass.

  Summed over the mesh axes it varies over and `primal` does not (a primal
  that is the same on every device was used by every device: its cotangent
  is the sum of theirs, as for JAX's own ops), and marked as varying over
  the axes `primal` varies over.
  """
  primal_axes = jax.typeof(primal).manual_axis_type.varying
  extra = tuple(sorted(jax.typeof(cotangent).manual_axis_type.varying - primal_axes))
  if extra:
    cotangent = jax.lax.psum(cotangent, extra)
  return vary_over(cotangent, primal_axes)


def varying_kernel(kernel: Callable, *, collective_axes: Iterable = ()) -> Callable:
  """`kernel` (a Mosaic GPU kernel call) with its results typed as varying over the
  manual mesh axes of its array arguments and over `collective_axes`.

  A kernel whose result depends on the device it runs on (it reads peers'
  memory, or `lax.axis_index`) names that mesh axis in `collective_axes`.
  """
  collective_axes = tuple(collective_axes)

  def call(*args):
    axes = varying_axes(args) | frozenset(collective_axes)
    return jax.tree.map(lambda out: vary_over(out, axes), kernel(*args))

  return call
