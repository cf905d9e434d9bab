"""The SM clock and power of a GPU under sustained load, sampled with nvidia-smi.

For benchmarks (`tools/bench_matmul.py --sustain_s`); kernel times come from
`core.timing`'s CUPTI measurements.
"""

from __future__ import annotations

import collections
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

import jax

# What `sustained_run` samples with nvidia-smi while it runs.
_CLOCK_QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
# Calls queued between host syncs in `sustained_run`.
_QUEUED_CALLS = 8


def sustained_run(fn: Callable, args: Sequence, *, flops: int, seconds: float,
                  sample_ms: int = 100) -> dict:
  """Runs `fn(*args)` back to back for `seconds` and samples the GPU meanwhile.

  The median of a few dozen runs (`core.timing.time_gpu`) hides what a GPU
  does under sustained load: at its power limit it lowers the SM clock, by an
  amount that depends on the data the tensor cores switch. This keeps calls
  queued for `seconds` while nvidia-smi samples GPU 0 every `sample_ms`.

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
