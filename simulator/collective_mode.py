"""`collective_interpret_mode`: GPU interpret mode with semaphores and peer memory.

The entry point of the simulator: it installs the interpreter patches
(`patches.install`), enters `core.interpret.interpret_mode`, sets the timeout
of semaphore waits, and turns a wait that timed out into a `TimeoutError`.
"""

from __future__ import annotations

import contextlib

import jax

from core import interpret
from simulator import patches, semaphores


@contextlib.contextmanager
def collective_interpret_mode(*, detect_races: bool = True,
                              wait_timeout_s: float = semaphores.DEFAULT_WAIT_TIMEOUT_S,
                              tma_threads_per_device: int = interpret.TMA_THREADS_PER_DEVICE):
  """Interprets the kernels traced inside the block, with semaphores and peer memory.

  Installs the extension (see `simulator.install`), enters
  `interpret.interpret_mode`, and makes a `semaphore_wait` that is still
  unsatisfied after `wait_timeout_s` seconds fail instead of hanging. A kernel
  that issues more TMA copies than `tma_threads_per_device` x devices logs a
  warning (see `core.interpret`: the race detector may then miss a copy nobody
  waited for). An exception leaving the block resets the interpreter
  (`interpret.reset_after_failure`); one caught inside it needs that call.

  The timeout is raised inside a callback of the running kernel, so jax
  reports it as a `jax.errors.JaxRuntimeError` wherever the kernel's outputs
  are first waited for, which may be after the block. The block therefore
  waits for every kernel it started when it ends (`jax.effects_barrier`) and
  raises a wait timeout that leaves it as a `TimeoutError` (chained from jax's
  error). One caught inside the block is still jax's error.

  Settings are read when a kernel is lowered (like `interpret_mode`), so a
  function already compiled keeps the timeout it was compiled with.
  """
  if not wait_timeout_s > 0:
    raise ValueError(f"wait_timeout_s must be positive, got {wait_timeout_s=}")
  patches.install()
  token = semaphores.wait_timeout_s.set(float(wait_timeout_s))
  try:
    with interpret.interpret_mode(detect_races=detect_races,
                                  tma_threads_per_device=tma_threads_per_device):
      try:
        yield
        # Dispatch is asynchronous: a kernel started in the block may still run.
        jax.effects_barrier()
      except jax.errors.JaxRuntimeError as e:
        timeout = semaphores.timeout_in(e)
        if timeout is None:
          raise
        raise timeout from e
  finally:
    semaphores.wait_timeout_s.reset(token)
