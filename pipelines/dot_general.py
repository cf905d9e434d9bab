"""`dot_general`: `jax.lax.dot_general`'s signature, run on `matmul` where it can.

A drop-in for the `dot_general=` argument of Flax layers, so a model runs its
dense products on the warp-specialized kernel without being rewritten:

    layer = nnx.Linear(1024, 4096, dot_general=pipelines.dot_general,
                       dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)

`nnx.Linear` calls it as `dot_general(x, kernel, (((x.ndim - 1,), (0,)),
((), ())), precision=..., out_sharding=...)`, and `preferred_element_type=`
when the layer has one. Such a call runs on the kernel when:

  * the contraction is lhs's last dimension with rhs's first (a Dense
    weight stored (K, N)) or with rhs's last (a weight stored (N, K), read
    in place through `transpose_rhs`), and dimension_numbers has no batch
    dimensions;
  * rhs is 2-D; lhs has one or more dimensions, all but the last folded
    into the kernel's M (a free reshape of a row-major array);
  * both operands are float16, or both bfloat16;
  * precision is None or DEFAULT, preferred_element_type is None (the
    operand dtype, as in lax), float16, bfloat16 or float32, and
    out_sharding is None.

Everything else goes to `jax.lax.dot_general` unchanged, so results and
errors are lax's own there, and the reason is logged (logger
"pipelines.dot_general", WARNING) the first time it comes up in the process,
which is when the layer is traced: a float32 layer (Flax's default
`param_dtype` without a 16-bit `dtype`) says so once instead of silently
running on XLA.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator

import jax
import jax.numpy as jnp
from jax import lax

from pipelines.matmul import matmul

_log = logging.getLogger(__name__)

# Operand dtypes the kernel's wgmma reads, and the output dtypes its epilogue writes.
_KERNEL_OPERAND_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_KERNEL_OUT_DTYPES = (*_KERNEL_OPERAND_DTYPES, jnp.dtype(jnp.float32))

# Each distinct reason for a fallback is logged once per process: a model
# traces the same layer many times (every jit, every grad), and one line per
# reason says what the user needs to know.
_LOGGED_REASONS: set[str] = set()


@dataclasses.dataclass(frozen=True)
class _KernelCall:
  """How a dot_general call maps onto `matmul`."""

  transpose_rhs: bool  # rhs stored (N, K) rather than (K, N).
  out_dtype: jnp.dtype


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                out_sharding=None) -> jax.Array:
  """`jax.lax.dot_general`, on the Hopper matmul kernel where the call allows.

  Args:
    lhs: (..., K) float16 or bfloat16 for the kernel; the leading dimensions
      (none or any number) are rows of the product. Anything else lax takes.
    rhs: (K, N) contracted over its first dimension, or (N, K) over its
      last, of lhs's dtype, for the kernel. Anything else lax takes.
    dimension_numbers: `((lhs_contracting, rhs_contracting), (lhs_batch,
      rhs_batch))` as in lax; the kernel takes `(((lhs.ndim - 1,), (0,)),
      ((), ()))` and `(((lhs.ndim - 1,), (1,)), ((), ()))`.
    precision: None or DEFAULT for the kernel, which multiplies 16-bit
      operands and accumulates in float32.
    preferred_element_type: the output dtype, float16, bfloat16 or float32
      for the kernel; None gives the operand dtype, as lax does.
    out_sharding: None for the kernel.

  The module docstring lists when the kernel runs; every other call is
  `jax.lax.dot_general(...)` with the same arguments, and its reason is
  logged once. On the kernel, `jax.grad` goes through `matmul`'s custom VJP
  (its backward products run on the kernel too), so forward-mode
  differentiation (`jax.jvp`) is refused there.

  Returns:
    (..., N) of `preferred_element_type` (default: the operand dtype) on the
    kernel; what lax returns otherwise.
  """
  plan = _kernel_call(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                      out_sharding)
  if isinstance(plan, str):
    _log_once(plan)
    return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                           out_sharding=out_sharding)
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  *leading, k = lhs.shape
  # lax puts lhs's free dimensions first and rhs's last; row-major (..., K)
  # is already (prod(...), K) in memory, so both reshapes are free.
  out = matmul(lhs.reshape(math.prod(leading), k), rhs, out_dtype=plan.out_dtype,
               transpose_rhs=plan.transpose_rhs)
  return out.reshape(*leading, out.shape[-1])


def _kernel_call(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                 out_sharding) -> _KernelCall | str:
  """The kernel call for these arguments, or why lax should take them."""
  if out_sharding is not None:
    # The kernel runs per device with no sharding of its own to give its output.
    return "out_sharding is set"
  try:
    (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
    lhs_contracting, rhs_contracting = _dims(lhs_contracting), _dims(rhs_contracting)
    lhs_batch, rhs_batch = _dims(lhs_batch), _dims(rhs_batch)
  except (TypeError, ValueError):
    return f"dimension_numbers={dimension_numbers!r} is not ((contracting), (batch)) pairs"
  if lhs_batch or rhs_batch:
    return (f"batch dimensions {lhs_batch} x {rhs_batch} in dimension_numbers "
            "(the kernel has none)")
  lhs_shape, rhs_shape = jnp.shape(lhs), jnp.shape(rhs)
  if len(rhs_shape) != 2:
    return f"rhs has {len(rhs_shape)} dimensions (the kernel takes a 2-D rhs)"
  lhs_last = len(lhs_shape) - 1
  if lhs_last < 0 or lhs_contracting != (lhs_last,) or rhs_contracting not in ((0,), (1,)):
    return (f"contracting dimensions {lhs_contracting} x {rhs_contracting} of "
            f"{len(lhs_shape)}-D x 2-D operands (the kernel contracts lhs's last dimension "
            "with rhs's first or last)")
  transpose_rhs = rhs_contracting == (1,)
  if lhs_shape[lhs_last] != rhs_shape[rhs_contracting[0]]:
    # lax raises its own error for this.
    return f"contracting dimensions of different sizes ({lhs_shape} x {rhs_shape})"
  lhs_dtype, rhs_dtype = jnp.result_type(lhs), jnp.result_type(rhs)
  if lhs_dtype != rhs_dtype:
    return f"mixed operand dtypes {lhs_dtype.name} x {rhs_dtype.name} (the kernel takes one)"
  if lhs_dtype not in _KERNEL_OPERAND_DTYPES:
    return f"{lhs_dtype.name} operands (the kernel takes float16 or bfloat16)"
  if not _is_default_precision(precision):
    # On 16-bit operands a precision changes nothing in XLA's product on a
    # GPU either (it governs float32 operands), but a caller who asked for
    # one asked for XLA's semantics; a log line costs less than a surprise.
    return f"precision={precision!r} (the kernel has only the default)"
  out_dtype = lhs_dtype if preferred_element_type is None else _dtype(preferred_element_type)
  if out_dtype not in _KERNEL_OUT_DTYPES:
    return (f"preferred_element_type={preferred_element_type!r} (the kernel writes float16, "
            "bfloat16 or float32)")
  return _KernelCall(transpose_rhs=transpose_rhs, out_dtype=out_dtype)


def _dims(dims) -> tuple[int, ...]:
  """A dimension or sequence of dimensions, as lax takes them, as a tuple of ints."""
  if isinstance(dims, (tuple, list)):
    return tuple(operator.index(d) for d in dims)
  return (operator.index(dims),)


def _dtype(dtype) -> jnp.dtype | None:
  """`dtype` as a numpy dtype, or None where it names none (lax then decides)."""
  try:
    return jnp.dtype(dtype)
  except TypeError:
    return None


def _is_default_precision(precision) -> bool:
  """Whether `precision` (in any form lax takes) asks for nothing but the default."""
  if precision is None:
    return True
  if isinstance(precision, (tuple, list)):
    return len(precision) == 2 and all(_is_default_precision(p) for p in precision)
  if isinstance(precision, str):
    try:
      # lax's aliases: "default", "fastest", "bfloat16", ...
      return lax.Precision(precision) == lax.Precision.DEFAULT
    except ValueError:
      # Or the name of a `lax.DotAlgorithmPreset`.
      return precision == lax.DotAlgorithmPreset.DEFAULT.name
  return precision in (lax.Precision.DEFAULT, lax.DotAlgorithmPreset.DEFAULT)


def _log_once(reason: str) -> None:
  if reason in _LOGGED_REASONS:
    return
  _LOGGED_REASONS.add(reason)
  _log.warning("dot_general runs on jax.lax.dot_general, not the Mosaic GPU kernel: %s", reason)
