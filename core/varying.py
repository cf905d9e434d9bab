"""`vary_like`: a value typed as varying over the mesh axes another value varies over.

Inside `jax.shard_map` every value says over which manual mesh axes it varies,
and a custom VJP's cotangent must have its primal's type. Mosaic GPU kernels'
outputs do not say over which manual axes they vary, so the backward passes
built on them (`pipelines.matmul`, the collective matmuls) mark their
cotangents with this.
"""

from __future__ import annotations

import jax


def vary_like(value, like):
  """`value`, marked as varying over the mesh axes `like` varies over (a no-op outside
  `jax.shard_map` and where it already does)."""
  axes = jax.typeof(like).manual_axis_type.varying
  missing = tuple(axes - jax.typeof(value).manual_axis_type.varying)
  return jax.lax.pcast(value, missing, to="varying") if missing else value
