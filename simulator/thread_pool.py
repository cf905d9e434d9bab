"""XLA's CPU threads, which every simulated GPU thread occupies while it runs.

Each simulated thread (a warpgroup of a block of a device) is an XLA execution
on a CPU device, and one that waits (a semaphore, a barrier) blocks the CPU
thread its callback runs on. Two limits of XLA's CPU client matter:

  * Its intra-op thread pool has max(`PJRT_NPROC` (or the CPU count), CPU
    devices) threads, fixed when jax creates the CPU client. XLA continues a
    program's thunks on the pool thread that finished their inputs, so with
    fewer pool threads than simulated threads the waiters can take them all
    while the thread they wait for has thunks queued on the pool: nobody runs
    (a deadlock that shows up as a wait timeout). `reserve_intra_op_threads`
    sizes the pool, and must run before jax starts its CPU backend;
    `check_intra_op_pool` refuses a kernel that could exhaust the pool it got.
  * It runs at most 32 executions at once per CPU device and queues the rest,
    so simulated threads are spread over the CPU devices
    (`on_cpu_device_with_room`), at most `THREADS_PER_CPU_DEVICE` on each.

Nothing here runs on import: a test program calls `reserve_intra_op_threads()`
before it touches jax's devices, or its environment sets `PJRT_NPROC`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading

import jax
from jax._src import xla_bridge

from core.interpret import intra_op_pool_size

# Threads XLA's CPU client gives its intra-op pool and its dispatch pool when
# `reserve_intra_op_threads` sets `PJRT_NPROC`; XLA caps the intra-op pool at 256.
INTRA_OP_THREADS = 128
# Pool threads kept free of simulated threads: the per-device programs that
# wait for their simulated threads (one per device, on top of the simulated
# threads) and the small computations callbacks run.
SPARE_POOL_THREADS = 4

# XLA's CPU client runs at most 32 executions at once per device; we keep
# some of them free for the small computations the interpreter's callbacks
# run (jnp operations on their arguments).
THREADS_PER_CPU_DEVICE = 24


def reserve_intra_op_threads(num_threads: int = INTRA_OP_THREADS) -> bool:
  """Sizes XLA's CPU thread pools for simulated threads, if jax has no backend yet.

  XLA reads `PJRT_NPROC` once, when jax creates its CPU client (the first
  `jax.devices()`, array or computation), so call this before any of them.
  Does nothing where `PJRT_NPROC` is set or a backend exists. Returns whether
  it set `PJRT_NPROC`.
  """
  if "PJRT_NPROC" in os.environ or xla_bridge.backends_are_initialized():
    return False
  os.environ["PJRT_NPROC"] = str(num_threads)
  return True


def check_intra_op_pool(threads: int, num_devices: int) -> None:
  """Raises unless XLA's intra-op pool has a thread left when `threads` simulated threads wait."""
  pool = intra_op_pool_size()
  needed = threads + num_devices + SPARE_POOL_THREADS
  if needed > pool:
    raise NotImplementedError(
        f"Interpreting this kernel takes {threads} concurrent simulated threads, each of which "
        f"may block a thread of XLA's CPU intra-op pool while it waits, but that pool has only "
        f"{pool} threads (it needs {needed}), so the kernel could deadlock. Set the environment "
        f"variable PJRT_NPROC={max(needed, INTRA_OP_THREADS)} before jax starts its CPU "
        "backend (simulator.reserve_intra_op_threads() does that), or use a smaller grid.")


def max_concurrent_threads() -> int:
  """How many simulated threads may run at once on this process's CPU devices."""
  return THREADS_PER_CPU_DEVICE * jax.local_device_count("cpu")


_threads_on_device: collections.Counter = collections.Counter()
_threads_lock = threading.Lock()


@contextlib.contextmanager
def on_cpu_device_with_room():
  """Runs the simulated thread started in the block on a CPU device with room for it.

  Yields that device (also jax's default device inside the block): the first
  with fewer than `THREADS_PER_CPU_DEVICE` simulated threads, else the least
  busy. Filling devices in order keeps a kernel's threads on few devices,
  and each device compiles the threads' program again.
  """
  devices = jax.local_devices(backend="cpu")
  with _threads_lock:
    device = next((d for d in devices if _threads_on_device[d.id] < THREADS_PER_CPU_DEVICE),
                  None)
    if device is None:
      device = min(devices, key=lambda d: _threads_on_device[d.id])
    _threads_on_device[device.id] += 1
  try:
    with jax.default_device(device):
      yield device
  finally:
    with _threads_lock:
      _threads_on_device[device.id] -= 1
