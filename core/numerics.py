"""How close a kernel's output is to its reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Relative error ||out - ref|| / ||ref|| a kernel may have against a float32
# reference, by operand dtype: f16 keeps 11 significant bits, bf16 8.
RELATIVE_TOLERANCE = {
    jnp.dtype(jnp.float16): 2e-3,
    jnp.dtype(jnp.bfloat16): 1e-2,
    jnp.dtype(jnp.float32): 1e-5,
}


def relative_error(out, ref) -> float:
  """||out - ref|| / ||ref|| in float64; a NaN or inf anywhere in `out` gives inf.

  Outputs start poisoned with NaN in tests, so an element the kernel never
  wrote makes this infinite.
  """
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  if out.shape != ref.shape:
    raise ValueError(f"shape mismatch: {out.shape=} vs {ref.shape=}")
  if not np.all(np.isfinite(out)):
    return float("inf")
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def relative_error_on_device(out, ref) -> float:
  """`relative_error` computed where the arrays live (float32), for sharded outputs.

  Works on arrays spread over devices of several processes, which cannot be
  copied to one host; every process gets the same value.
  """
  if out.shape != ref.shape:
    raise ValueError(f"shape mismatch: {out.shape=} vs {ref.shape=}")
  return float(_relative_error_jit(out, ref))


@jax.jit
def _relative_error_jit(out, ref):
  out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
  err = jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30)
  return jnp.where(jnp.all(jnp.isfinite(out)), err, jnp.inf)
