"""The ring schedule of the matmul + reduce-scatter, as plain functions.

D devices form a ring; device d holds lhs_d (M, K_shard) and rhs_d (K_shard,
N) and must end with row block d (M / D rows) of the sum over devices of
lhs_i @ rhs_i. At step s (0 <= s < D) device d computes its partial product
of row block `(d + s + 1) % D`, adds the running sum of that block it
received at the previous step (none at step 0), and sends the new sum to its
ring predecessor `(d - 1) % D`, which works on the same block one step
later. After D steps each block has collected every device's partial once
and the last step's block, `d` itself, is final: it goes to the output, not
to a peer. So D - 1 sums travel, each into a scratch slot of its own on the
receiver (slot s holds what was sent at step s), and no slot is reused.

The ring itself, its scratch slots and which steps send are the all-gather
ring's (`collectives.schedule`), imported here so that this module reads as
the whole schedule. The functions take Python ints or traced int32 scalars
alike, so the Mosaic kernel, the portable XLA twin and the tests use the same
arithmetic.
"""

from __future__ import annotations

from collectives.schedule import (
  num_scratch_slots,
  read_slot,
  receive_source,
  send_slot,
  send_target,
  sends_at_step,
)

__all__ = [
    "adds_at_step", "block_at_step", "num_scratch_slots", "read_slot", "receive_source",
    "send_slot", "send_target", "sends_at_step", "signals_per_slot",
]


def block_at_step(device, step, num_devices):
  """The row block whose partial product device `device` computes at `step`."""
  return (device + step + 1) % num_devices


def adds_at_step(step):
  """Whether a device adds a received sum at `step` (every step but the first)."""
  return step > 0


def signals_per_slot(num_blocks: int, signallers_per_block: int) -> int:
  """Signals a scratch slot's semaphore gets: one per storing warpgroup of each sender block.

  Every compute warpgroup of every block of the sender stores part of the
  slot with its own TMA stores, which only it can wait for; each signals once
  its stores have landed, so the full count means the whole slot is there.
  One semaphore per slot: blocks do not run in lockstep, and a count shared
  by all steps could be completed by a block that is a step ahead.
  """
  return num_blocks * signallers_per_block
