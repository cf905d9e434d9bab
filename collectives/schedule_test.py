"""The ring schedules (all-gather and reduce-scatter), simulated in Python for ring sizes 1 to 8."""

from absl.testing import absltest, parameterized

from collectives import schedule

RING_SIZES = tuple(range(1, 9))


class ScheduleTest(parameterized.TestCase):

  @parameterized.parameters(*RING_SIZES)
  def test_every_device_computes_every_shard_once(self, d):
    for device in range(d):
      shards = [schedule.shard_at_step(device, step, d) for step in range(d)]
      self.assertCountEqual(shards, range(d))
      self.assertEqual(shards[0], device, "step 0 must use the local shard")

  @parameterized.parameters(*RING_SIZES)
  def test_send_and_receive_are_inverse(self, d):
    for device in range(d):
      self.assertEqual(schedule.receive_source(schedule.send_target(device, d), d), device)
    self.assertCountEqual([schedule.send_target(x, d) for x in range(d)], range(d))

  @parameterized.parameters(*RING_SIZES)
  def test_simulated_ring_delivers_the_right_shard_to_each_slot(self, d):
    """Plays the ring: each send lands in a fresh slot that the receiver reads next step."""
    scratch = [[None] * schedule.num_scratch_slots(d) for _ in range(d)]
    holding = list(range(d))  # Device i starts with its own LHS shard.
    for step in range(d):
      for device in range(d):
        self.assertEqual(holding[device], schedule.shard_at_step(device, step, d))
      for device in range(d):
        if schedule.sends_at_step(step, d):
          target, slot = schedule.send_target(device, d), schedule.send_slot(step)
          self.assertIsNone(scratch[target][slot], "a scratch slot was written twice")
          scratch[target][slot] = holding[device]
      if step + 1 < d:
        holding = [scratch[device][schedule.read_slot(step + 1)] for device in range(d)]
    for device in range(d):
      self.assertNotIn(None, scratch[device], "a scratch slot was never written")

  @parameterized.parameters(*RING_SIZES)
  def test_sends_stop_at_the_last_step(self, d):
    self.assertEqual(sum(schedule.sends_at_step(step, d) for step in range(d)), d - 1)
    self.assertFalse(schedule.sends_at_step(d - 1, d))

  @parameterized.parameters(*RING_SIZES)
  def test_simulated_reduce_scatter_ring_sums_every_device_into_its_own_block(self, d):
    """Plays the reduce-scatter ring: each partial collects every device once and ends
    at the device that owns its block."""
    contributors = [None] * d  # What device i received at the previous step.
    for step in range(d):
      sums = []
      for device in range(d):
        block = schedule.reduce_scatter_block_at_step(device, step, d)
        received = contributors[device] or (block, frozenset())
        self.assertEqual(received[0], block, "a partial was added to another block's")
        sums.append((block, received[1] | {device}))
      if schedule.sends_at_step(step, d):
        contributors = [None] * d
        for device in range(d):
          contributors[schedule.send_target(device, d)] = sums[device]
    for device in range(d):
      self.assertEqual(sums[device], (device, frozenset(range(d))))


if __name__ == "__main__":
  absltest.main()
