"""How close a kernel's output is to its reference."""

from __future__ import annotations

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
