"""Timing for benchmarks and autotuning: warm-up, then CUPTI kernel times or wall clock.

`time_gpu` counts only the device time of the kernels a call launches (Mosaic
GPU's CUPTI profiler), not host dispatch, so a kernel and its baseline (cuBLAS
through `jnp.dot`, NCCL collectives) are compared on equal terms. CUPTI gives
each kernel's duration, and their sum is the call's time only while the
kernels run one after another. A program whose kernels overlap on several
streams (XLA's asynchronous collectives beside its dots) is timed by
`time_wall` instead, as are programs on CPUs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax

from core.numerics import relative_error_on_device

DEFAULT_ITERATIONS = 50


def _tflops(flops: int, us: float) -> float:
  return flops / (us * 1e-6) / 1e12


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
  """One benchmarked function: compile time, per-run times, median, rate."""

  name: str
  config: str
  compile_s: float
  times_us: tuple[float, ...]
  flops: int

  @property
  def median_us(self) -> float:
    return statistics.median(self.times_us)

  @property
  def tflops(self) -> float:
    return _tflops(self.flops, self.median_us)


def _compile(fn: Callable, args: Sequence) -> tuple[Callable, jax.Array, float]:
  """(jitted fn, the output of its first call, seconds that call took: compile and run)."""
  jitted = jax.jit(fn)
  start = time.perf_counter()
  out = jax.block_until_ready(jitted(*args))
  return jitted, out, time.perf_counter() - start


def time_gpu(name: str, fn: Callable, args: Sequence, *, flops: int, config: str = "",
             iterations: int = DEFAULT_ITERATIONS, num_devices: int = 1
             ) -> tuple[Timing, jax.Array]:
  """Compiles and warms `fn(*args)` up, then measures `iterations` runs.

  `num_devices`: how many GPUs of this process one call runs on (a sharded
  call). CUPTI reports every device's kernels; their total is divided by it,
  giving the mean device time per call (a collective kernel that waits for a
  slower peer counts that wait). `flops` is then the work of one device.

  Returns the timing and the output of the warm-up call (for checking).
  """
  from jax.experimental.mosaic.gpu import profiler  # Needs CUDA; import late.

  jitted, out, compile_s = _compile(fn, args)
  for _ in range(3):
    jax.block_until_ready(jitted(*args))
  _, runtimes_ms = profiler.measure(jitted, iterations=iterations)(*args)
  if runtimes_ms is None:
    raise RuntimeError(f"{name}: no GPU kernel was launched")
  if iterations == 1:
    # The profiler gives one call's time as a number, not a list of one.
    runtimes_ms = [runtimes_ms]
  return Timing(name=name, config=config, compile_s=compile_s,
                times_us=tuple(t * 1e3 / num_devices for t in runtimes_ms), flops=flops), out


def time_wall(name: str, fn: Callable, args: Sequence, *, flops: int,
              iterations: int = DEFAULT_ITERATIONS, calls_per_sample: int = 1
              ) -> tuple[Timing, jax.Array]:
  """Compiles and warms `fn(*args)` up, then measures wall-clock time per call.

  Each of `iterations` samples issues `calls_per_sample` calls back to back
  and waits for them all: with several calls the host dispatches the next
  while the device runs the previous one, so a sample of a device-bound
  program is its device time, overlapped kernels counted once (launch gaps
  included, which CUPTI leaves out). With one call per sample the time
  includes dispatch and synchronization.

  Returns the timing (per call) and the output of the warm-up call.
  """
  if iterations < 1 or calls_per_sample < 1:
    raise ValueError(f"iterations={iterations} and calls_per_sample={calls_per_sample} "
                     "must be >= 1")
  jitted, out, compile_s = _compile(fn, args)
  times_us = []
  for _ in range(iterations):
    start = time.perf_counter()
    jax.block_until_ready([jitted(*args) for _ in range(calls_per_sample)])
    times_us.append((time.perf_counter() - start) * 1e6 / calls_per_sample)
  return Timing(name=name, config="", compile_s=compile_s, times_us=tuple(times_us),
                flops=flops), out


def compare_rounds(timings: Sequence[Timing], baseline: Sequence[Timing]) -> dict:
  """One function's rounds of timings against a baseline's, round by round.

  A GPU's clock drifts under sustained load, so a ratio is only fair between
  runs close in time: round i of `timings` is compared with round i of
  `baseline` (the same number of rounds).

  Returns the median of the rounds' medians (`median_us`, and `tflops` from
  it), the median and range of the per-round speed ratios baseline / timings
  (`ratio`, `ratio_min`, `ratio_max`; above 1 is faster than the baseline)
  and every round's median (`round_median_us`).
  """
  if not timings or len(timings) != len(baseline):
    raise ValueError(f"need the same number (>= 1) of rounds, got {len(timings)} "
                     f"and {len(baseline)} for the baseline")
  medians = [t.median_us for t in timings]
  ratios = [b.median_us / t.median_us for t, b in zip(timings, baseline, strict=True)]
  median_us = statistics.median(medians)
  return dict(median_us=median_us, tflops=_tflops(timings[0].flops, median_us),
              ratio=statistics.median(ratios), ratio_min=min(ratios),
              ratio_max=max(ratios), round_median_us=medians)


def time_in_rounds(impls: dict[str, Callable], args: Sequence, *, flops: int, baseline: str,
                   reference, iterations: int, rounds: int) -> dict[str, dict]:
  """Times `impls` taking turns for `rounds` rounds (`time_gpu`), each against `baseline`.

  Returns one record per implementation: `kernel` (its name), `compile_s`, `rel_error`
  (the largest over its outputs' leaves against `reference`'s, worked out in float32
  where the arrays live: a float64 copy on the host took seconds for an output of 10^8
  elements) and `compare_rounds`'s summary with the ratio under `ratio_to_dot`; or
  `kernel` and `error` for one that raised, which is not timed again and does not stop
  the others.
  """
  timings = {name: [] for name in impls}
  records = {}
  for _ in range(rounds):
    for name, fn in impls.items():
      if "error" in records.get(name, {}):
        continue
      try:
        t, out = time_gpu(name, fn, args, flops=flops, iterations=iterations)
      except Exception as e:  # noqa: BLE001 - a failing implementation is reported.
        records[name] = dict(kernel=name, error=f"{type(e).__name__}: {e}"[:300])
        continue
      timings[name].append(t)
      if name not in records:
        error = max(relative_error_on_device(o, r)
                    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(reference), strict=True))
        records[name] = dict(kernel=name, compile_s=t.compile_s, rel_error=error)
  for name, record in records.items():
    if "error" not in record and timings[baseline]:
      summary = compare_rounds(timings[name], timings[baseline])
      record.update(summary, ratio_to_dot=summary.pop("ratio"))
  return records
