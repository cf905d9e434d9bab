"""The ring schedule of the all-gather matmul, as plain functions.

D devices form a ring. Device d starts with its own LHS shard and, at step i
(0 <= i < D), multiplies the shard it holds by its RHS shard into the output
rows of shard `(d + i) % D`, while it forwards that same shard to device
`(d - 1) % D`. What a device forwards at step i arrives in the receiver's
scratch slot i, which the receiver multiplies at step i + 1; the last step
forwards nothing, so D - 1 slots suffice and each is written exactly once.

The matmul + reduce-scatter sends its running sums around the same ring, into
the same slots (`reduce_scatter_schedule`). The functions take Python ints or
traced int32 scalars alike, so the Mosaic kernel, the portable XLA twin and
the tests all use the same arithmetic.
"""

from __future__ import annotations


def shard_at_step(device, step, num_devices):
  """Index of the LHS shard (and of the output row block) device `device` computes at `step`."""
  return (device + step) % num_devices


def step_of_shard(device, shard, num_devices):
  """The step at which device `device` computes LHS shard `shard` (inverts `shard_at_step`)."""
  return (shard - device) % num_devices


def send_target(device, num_devices):
  """The device that receives this device's forwarded shards: its ring predecessor."""
  return (device + num_devices - 1) % num_devices


def receive_source(device, num_devices):
  """The device whose forwarded shards this device receives: its ring successor."""
  return (device + 1) % num_devices


def sends_at_step(step, num_devices):
  """Whether a device forwards its current shard at `step` (every step but the last)."""
  return step < num_devices - 1


def num_scratch_slots(num_devices: int) -> int:
  """Receive slots per device: one per forwarded shard."""
  return num_devices - 1


def send_slot(step):
  """The receiver's scratch slot that the shard forwarded at `step` lands in."""
  return step


def read_slot(step):
  """The scratch slot a device reads its LHS from at `step` >= 1 (step 0 reads its own shard)."""
  return step - 1


def signals_per_slot(num_blocks: int) -> int:
  """Signals a scratch slot's semaphore gets: one per block of the sender.

  Each slot has a semaphore of its own, signalled once by every block of the
  sender after that block's copies into the slot have landed, so a count of
  `num_blocks` means the whole slot is there. (One counter shared by all
  steps would not: a fast block could signal step s + 1 before a slow one
  signalled step s, and the count would reach its target early.)
  """
  return num_blocks

