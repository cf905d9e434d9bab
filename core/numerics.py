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


# The element-wise bound, by operand dtype: |out - ref| <= RTOL * |ref| +
# ATOL * rms(ref). The norm-wise error above averages: at the bfloat16
# tolerance about 1,600 zeroed elements of a 4096x4096 output still pass it.
# This bound catches one: rounding a 16-bit output moves an element by at
# most half an ulp (2**-9 of |ref| in bfloat16, 2**-12 in float16), and
# float32 accumulation orders differ by far less than ATOL. An element left
# at 0 fails wherever |ref| > ATOL * rms(ref), which is nearly everywhere.
ELEMENTWISE_TOLERANCE = {
    jnp.dtype(jnp.float16): (2**-10, 2e-3),
    jnp.dtype(jnp.bfloat16): (2**-7, 1e-2),
    jnp.dtype(jnp.float32): (1e-6, 1e-6),
}


def elementwise_violations(out, ref, dtype) -> tuple[int, str]:
  """Elements of `out` outside `ELEMENTWISE_TOLERANCE[dtype]` of the float32 `ref`.

  Returns their count and a description of the worst one ("" when none).
  A NaN or inf in `out` counts as a violation.
  """
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  if out.shape != ref.shape:
    raise ValueError(f"shape mismatch: {out.shape=} vs {ref.shape=}")
  if not out.size:
    return 0, ""
  rtol, atol = ELEMENTWISE_TOLERANCE[jnp.dtype(dtype)]
  bound = rtol * np.abs(ref) + atol * np.sqrt(np.mean(ref * ref))
  excess = np.where(np.isfinite(out), np.abs(out - ref) - bound, np.inf)
  bad = int(np.count_nonzero(excess > 0))
  if not bad:
    return 0, ""
  worst = np.unravel_index(np.argmax(excess), out.shape)
  return bad, (f"worst at {tuple(int(i) for i in worst)}: {out[worst]:.6g} vs reference "
               f"{ref[worst]:.6g}, bound {bound[worst]:.3g}")


def relative_error(out, ref) -> float:
  """||out - ref|| / ||ref|| in float64; a NaN or inf anywhere in `out` gives inf.

  In interpret mode every output starts as NaN, so an element the kernel never
  wrote makes this infinite. On a GPU that holds only for memory poisoned by
  `testing.KernelTestCase.run_kernel`, where an unwritten 16-bit element may
  also read 0 (which `elementwise_violations` catches, not this).
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
