"""The shared base of this repo's kernel tests (never imported by kernel code).

One test file runs in two places: on CPU in GPU interpret mode with race
detection (`MGPU_TEST_BACKEND=interpret`, the CI run) and on a real Hopper GPU
(`MGPU_TEST_BACKEND=gpu`). Unset, the backend follows the machine. A GPU run on
a machine without a Hopper GPU skips every test and says why.

Habits enforced here: inputs are random normal from a fixed key per test,
never zeros; an output element the kernel never writes is poison and fails
the comparison; every interpreted kernel is checked for races, not only the
last of a call; errors are relative to a float32 reference, norm-wise and
element-wise, with one tolerance per operand dtype.

Poison, precisely: in interpret mode the interpreter fills every buffer it
allocates, outputs included, with NaN (integers with their maximum), inside
`run_kernel` or not. On a GPU nothing does that for every buffer:
`KernelTestCase.run_kernel` first fills and frees twice the outputs' bytes
with float32 NaN on every device, so outputs the allocator places in that
memory start poisoned (16-bit elements there alternate 0 and NaN; the
element-wise bound of `assert_close` nearly always catches a stray 0). A
kernel called on a GPU outside `run_kernel` gets whatever memory was there.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from core import device, interpret, jax_private
from core.numerics import RELATIVE_TOLERANCE, elementwise_violations, relative_error

BACKEND_ENV = "MGPU_TEST_BACKEND"
# How much less accurate than XLA's result a kernel's may be, as a fraction of
# XLA's error (`KernelTestCase.assert_as_accurate_as`).
BASELINE_SLACK = 0.01
INTERPRET, GPU = "interpret", "gpu"

def backend() -> str:
  """The backend this test process runs kernels on: "interpret" or "gpu"."""
  value = os.environ.get(BACKEND_ENV, "")
  if value not in ("", INTERPRET, GPU):
    raise ValueError(f"{BACKEND_ENV}={value!r}: expected {INTERPRET!r} or {GPU!r}")
  return value or (GPU if device.has_gpu() else INTERPRET)


def hopper_gpu_count() -> int:
  if not device.has_gpu():
    return 0
  return sum(device.device_facts(d).is_hopper for d in jax.devices("gpu"))


def random_array(seed: int, shape, dtype, *, scale: float = 1.0) -> jax.Array:
  """Random normal values (never all zeros) from a fixed `seed`."""
  values = scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)
  return values.astype(dtype)


def random_size(rng: np.random.Generator, limit: int) -> int:
  """A dimension in [1, limit] for tests of kernels that take any shape.

  Drawn where kernels break: a quarter below 24 (fewer rows or columns than
  any tile, K shorter than one step), half within 8 of a multiple of 64 (one
  past a tile, one short of it, off the 8-row and 16-byte alignments TMA
  needs), a quarter anywhere. `rng` is seeded by the test, so a failing draw
  fails again.
  """
  kind = rng.integers(4)
  if kind == 0:
    return int(rng.integers(1, min(24, limit) + 1))
  if kind == 3 or limit < 64:
    return int(rng.integers(1, limit + 1))
  edge = 64 * int(rng.integers(1, limit // 64 + 1)) + int(rng.integers(-8, 9))
  return min(max(edge, 1), limit)


def poison_device_allocator(nbytes: int) -> None:
  """Fills and frees `nbytes` of memory with NaN on every local GPU, so a fresh
  output buffer (which the allocator hands out from that freed memory)
  starts poisoned.

  Interpret mode needs no help: it fills every new buffer with NaN itself.
  """
  if backend() != GPU:
    return
  poisons = [jax.device_put(jnp.full((nbytes // 4 + 1024,), jnp.nan, jnp.float32), d)
             for d in jax.local_devices()]
  for poison in jax.block_until_ready(poisons):
    poison.delete()


def output_bytes(fn, *args, **kwargs) -> int:
  """Bytes of all outputs of `fn(*args, **kwargs)`, from its abstract evaluation.

  Only array arguments are made abstract; the others (shapes, dtypes, device
  counts) reach `fn` as they are, as they would in the real call.
  """
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in args]

  def with_arrays(*arrays):
    it = iter(arrays)
    whole = [next(it) if array else x for x, array in zip(args, is_array, strict=True)]
    return fn(*whole, **kwargs)

  outs = jax.eval_shape(with_arrays, *(x for x, array in zip(args, is_array, strict=True) if array))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(outs))


def equations(jaxpr):
  """Every equation of `jaxpr` and of the jaxprs inside it (a `pjit`'s, a
  `custom_vjp`'s, a loop's body), depth first."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for value in param if isinstance(param, tuple) else (param,):
        inner = getattr(value, "jaxpr", value)  # A closed jaxpr's, or a jaxpr.
        if hasattr(inner, "eqns"):
          yield from equations(inner)


def dot_dtypes(fn, *args) -> list[tuple]:
  """The dtypes (lhs, rhs, output) of each `dot_general` in `fn(*args)`'s
  top-level jaxpr, in order: whether an XLA baseline or path writes its
  products in the operand dtype, as `jnp.dot` does, or asks for float32."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [tuple(v.aval.dtype for v in (*eqn.invars, *eqn.outvars))
          for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general"]


@contextlib.contextmanager
def facts_of_the_fitted_gpu():
  """Inside the block every GPU has the facts of an H100 SXM or H200 (`HOPPER_DEFAULTS`).

  The config heuristics' constants (SM waves, persistent grids) were fitted on those
  132 SMs, and the tests of their choices say what they choose there. On a host whose
  GPU has another SM count (an H100 PCIe has 114) they rightly choose otherwise, so a
  test of the choices enters this and runs the same on any host. Not for tests that run
  kernels: those must see the real device.
  """
  with mock.patch.object(device, "_gpu_facts", return_value=device.HOPPER_DEFAULTS):
    yield


class KernelTestCase(parameterized.TestCase):
  """Base for kernel tests: picks the backend, skips without the hardware,
  and checks every interpreted kernel for races."""

  min_gpus = 1

  def setUp(self):
    super().setUp()
    self.backend = backend()
    if self.backend == GPU:
      count = hopper_gpu_count()
      if count < self.min_gpus:
        self.skipTest(
            f"{BACKEND_ENV}=gpu needs {self.min_gpus} Hopper GPU(s) (sm_90); this machine "
            f"has {count}. Run these tests on an H100/H200 host.")
    else:
      self.enter_context(interpret.interpret_mode(detect_races=True))
      self.kernel_race_states = self.enter_context(interpret.race_log())

  def run_kernel(self, fn, *args, **kwargs):
    """Calls `fn` on poisoned memory, waits for it, and fails on a race the
    interpreter saw in any kernel it launched."""
    if self.backend == GPU:
      # Twice the outputs: the allocator may place them anywhere in what was freed.
      poison_device_allocator(2 * output_bytes(fn, *args, **kwargs))
    else:
      first = len(self.kernel_race_states)
    out = jax.block_until_ready(fn(*args, **kwargs))
    if self.backend == INTERPRET:
      racy = [i for i, state in enumerate(self.kernel_race_states[first:]) if state.races_found]
      self.assertFalse(racy, f"race detector flagged kernel(s) {racy} of "
                       f"{len(self.kernel_race_states) - first} launched by this call")
    return out

  def assert_close(self, out, ref, *, dtype, tolerance: float | None = None):
    """`out` against the float32 `ref`: the norm-wise relative error within
    the dtype's tolerance (or `tolerance`), and every element within
    `numerics.ELEMENTWISE_TOLERANCE` (skipped when `tolerance` is given:
    a comparison between two kernels, not with the reference)."""
    name = jnp.dtype(dtype).name
    tol = RELATIVE_TOLERANCE[jnp.dtype(dtype)] if tolerance is None else tolerance
    err = relative_error(out, ref)
    self.assertLessEqual(err, tol, f"relative error {err:.3e} > {tol:.1e} ({name})")
    if tolerance is None:
      bad, worst = elementwise_violations(out, ref, dtype)
      self.assertEqual(bad, 0, f"{bad} of {ref.size} elements outside the {name} "
                       f"element-wise bound; {worst}")


  def assert_output_close(self, out, ref, *, operand_dtype):
    """`out`, of 16-bit operands, against the float32 `ref`: `assert_close`
    with the operand dtype's bounds (the tables of `core.numerics` are by
    operand dtype) and, for a float32 `out`, float32's norm-wise tolerance
    too, so that a float32 output keeps float32's precision. Float32's
    element-wise bound is for float32 operands: summed in another order, the
    elements of a 16-bit product move past it where the sum cancels (K =
    270: 1.5e-5 of an element of 0.2)."""
    self.assert_close(out, ref, dtype=operand_dtype)
    if out.dtype == jnp.float32:
      self.assert_close(out, ref, dtype=jnp.float32,
                        tolerance=RELATIVE_TOLERANCE[jnp.dtype(jnp.float32)])

  def assert_as_accurate_as(self, out, baseline, ref, *, dtype):
    """`out` no less accurate than `baseline` (XLA's result of the same 16-bit
    model) against the float32 `ref`, norm-wise and in elements outside
    `dtype`'s element-wise bound, up to `BASELINE_SLACK` of the baseline's:
    where both round the same values to 16 bits, they differ by float32
    summation order alone (0.03% of the error in float16, seen), while one
    rounding more than the baseline raises the error by tens of percent."""
    err, baseline_err = relative_error(out, ref), relative_error(baseline, ref)
    self.assertLessEqual(err, baseline_err * (1 + BASELINE_SLACK),
                         f"relative error {err:.6e}, the baseline's {baseline_err:.6e}")
    bad = elementwise_violations(out, ref, dtype)[0]
    baseline_bad = elementwise_violations(baseline, ref, dtype)[0]
    self.assertLessEqual(bad, math.floor(baseline_bad * (1 + BASELINE_SLACK)),
                         f"{bad} elements outside the {jnp.dtype(dtype).name} element-wise "
                         f"bound, the baseline's {baseline_bad}")


def lowered_for_gpu(fn, *args) -> str:
  """The StableHLO of `jax.jit(fn)(*args)` lowered for CUDA (works without a GPU)."""
  # A kernel keeps the interpret mode it was first traced with, and jax's
  # caches reuse a trace for the same shapes: clearing them on both sides
  # keeps this lowering and the interpreted runs of other tests apart.
  jax.clear_caches()
  try:
    with interpret.interpret_disabled():
      return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    jax.clear_caches()


def mosaic_kernel_count(lowered_text: str) -> int:
  """The Mosaic GPU kernels in a lowered program's text (`lowered_for_gpu`)."""
  return lowered_text.count("stablehlo.custom_call @mosaic_gpu")


def mosaic_smem_bytes(fn, *args) -> int:
  """The SMEM bytes Mosaic GPU itself allocates for the kernel `fn(*args)`.

  Lowers `fn` for CUDA (this works on CPU, no GPU needed) under an artificial
  SMEM limit of zero and reads the size from Mosaic GPU's refusal.
  """
  with interpret.interpret_disabled(), jax_private.artificial_shared_memory_limit(0):
    try:
      jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    except ValueError as e:
      match = re.search(r"smem_bytes=(\d+)", str(e))
      if match:
        return int(match.group(1))
      raise
  raise AssertionError("Mosaic GPU accepted a zero SMEM limit: no SMEM used?")
