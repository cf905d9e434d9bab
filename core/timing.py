"""GPU timing for benchmarks and autotuning: warm-up, then CUPTI kernel times.

Only the device time of the kernels a call launches is counted (Mosaic GPU's
CUPTI profiler), not host dispatch, so a kernel and its baseline (cuBLAS through
`jnp.dot`, NCCL collectives) are compared on equal terms.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

import jax

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

  jitted = jax.jit(fn)
  start = time.perf_counter()
  out = jax.block_until_ready(jitted(*args))
  compile_s = time.perf_counter() - start
  for _ in range(3):
    jax.block_until_ready(jitted(*args))
  _, runtimes_ms = profiler.measure(jitted, iterations=iterations)(*args)
  if runtimes_ms is None:
    raise RuntimeError(f"{name}: no GPU kernel was launched")
  return Timing(name=name, config=config, compile_s=compile_s,
                times_us=tuple(t * 1e3 / num_devices for t in runtimes_ms), flops=flops), out


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


# What `sustained_run` samples with nvidia-smi while it runs.
_CLOCK_QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
# Calls queued between host syncs in `sustained_run`.
_QUEUED_CALLS = 8


def sustained_run(fn: Callable, args: Sequence, *, flops: int, seconds: float,
                  sample_ms: int = 100) -> dict:
  """Runs `fn(*args)` back to back for `seconds` and samples the GPU meanwhile.

  The median of a few dozen runs (`time_gpu`) hides what a GPU does under
  sustained load: at its power limit it lowers the SM clock, by an amount
  that depends on the data the tensor cores switch. This keeps calls queued
  for `seconds` while nvidia-smi samples GPU 0 every `sample_ms`.

  Returns the medians of the samples (`sm_clock_mhz`, `power_w`,
  `temperature_c`), the commonest clock-event (throttle) reason bitmask
  (`clock_event_reasons`; see `nvidia-smi --help-query-gpu`) and
  `wallclock_tflops`, the rate over the whole run. That rate counts the
  host's dispatch gaps: it is only the device's rate for calls far longer
  than a dispatch (about a millisecond and up). A long CUPTI-timed loop
  would avoid that, but it keeps every call's output alive until it ends.
  """
  jitted = jax.jit(fn)
  jax.block_until_ready(jitted(*args))
  sampler = subprocess.Popen(
      ["nvidia-smi", "-i", "0", f"--query-gpu={_CLOCK_QUERY}", "--format=csv,noheader,nounits",
       f"--loop-ms={sample_ms}"], stdout=subprocess.PIPE, text=True)
  try:
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
      for _ in range(_QUEUED_CALLS):
        out = jitted(*args)
      jax.block_until_ready(out)
      runs += _QUEUED_CALLS
    elapsed = time.perf_counter() - start
  finally:
    sampler.terminate()
  samples = [line.split(", ") for line in sampler.communicate()[0].splitlines()]
  samples = [row for row in samples if len(row) == 4 and row[0].strip().isdigit()]
  if not samples:
    raise RuntimeError(f"nvidia-smi returned no samples of {_CLOCK_QUERY}")
  clock, power, temperature, reasons = zip(*samples, strict=True)
  return dict(wallclock_tflops=runs * flops / elapsed / 1e12,
              sm_clock_mhz=statistics.median(map(float, clock)),
              power_w=statistics.median(map(float, power)),
              temperature_c=statistics.median(map(float, temperature)),
              clock_event_reasons=collections.Counter(reasons).most_common(1)[0][0])
