"""The reduce-scatter ring schedule, played in Python for every ring size from 1 to 8."""

from absl.testing import absltest, parameterized

from collectives import reduce_scatter_schedule as schedule

RING_SIZES = tuple(range(1, 9))


class ReduceScatterScheduleTest(parameterized.TestCase):

  @parameterized.parameters(*RING_SIZES)
  def test_every_device_computes_every_block_once_and_its_own_last(self, d):
    for device in range(d):
      blocks = [schedule.block_at_step(device, step, d) for step in range(d)]
      self.assertCountEqual(blocks, range(d))
      self.assertEqual(blocks[-1], device, "the last step must give the device's own block")

  @parameterized.parameters(*RING_SIZES)
  def test_send_and_receive_are_inverse(self, d):
    for device in range(d):
      self.assertEqual(schedule.receive_source(schedule.send_target(device, d), d), device)
    self.assertCountEqual([schedule.send_target(x, d) for x in range(d)], range(d))

  @parameterized.parameters(*RING_SIZES)
  def test_simulated_ring_sums_each_partial_exactly_once(self, d):
    """Plays the ring with sums as multisets of (block, device) partials."""
    scratch = [[None] * schedule.num_scratch_slots(d) for _ in range(d)]
    outputs = [None] * d
    for step in range(d):
      sums = []
      for device in range(d):
        block = schedule.block_at_step(device, step, d)
        total = [(block, device)]
        if schedule.adds_at_step(step):
          received = scratch[device][schedule.read_slot(step)]
          self.assertIsNotNone(received, "a slot was read before it was written")
          self.assertTrue(all(b == block for b, _ in received),
                          f"device {device} added a sum of another block at step {step}")
          total += received
        sums.append(total)
      for device in range(d):
        if schedule.sends_at_step(step, d):
          target, slot = schedule.send_target(device, d), schedule.send_slot(step)
          self.assertIsNone(scratch[target][slot], "a scratch slot was written twice")
          scratch[target][slot] = sums[device]
        else:
          outputs[device] = sums[device]
    for device in range(d):
      self.assertCountEqual(outputs[device], [(device, i) for i in range(d)])
      self.assertNotIn(None, scratch[device], "a scratch slot was never written")

  @parameterized.parameters(*RING_SIZES)
  def test_simulated_ring_ends_each_sum_at_the_device_that_owns_its_block(self, d):
    """Plays the ring with sums as sets of devices: each partial collects
    every device once and ends at the device that owns its block."""
    contributors = [None] * d  # What device i received at the previous step.
    for step in range(d):
      sums = []
      for device in range(d):
        block = schedule.block_at_step(device, step, d)
        received = contributors[device] or (block, frozenset())
        self.assertEqual(received[0], block, "a partial was added to another block's")
        sums.append((block, received[1] | {device}))
      if schedule.sends_at_step(step, d):
        contributors = [None] * d
        for device in range(d):
          contributors[schedule.send_target(device, d)] = sums[device]
    for device in range(d):
      self.assertEqual(sums[device], (device, frozenset(range(d))))

  @parameterized.parameters(*RING_SIZES)
  def test_sends_stop_at_the_last_step_and_adds_skip_the_first(self, d):
    self.assertEqual(sum(schedule.sends_at_step(step, d) for step in range(d)), d - 1)
    self.assertFalse(schedule.sends_at_step(d - 1, d))
    self.assertEqual(sum(schedule.adds_at_step(step) for step in range(d)), d - 1)
    self.assertEqual(sorted(schedule.read_slot(s) for s in range(1, d)),
                     sorted(schedule.send_slot(s) for s in range(d - 1)))

  def test_every_storing_warpgroup_signals(self):
    self.assertEqual(schedule.signals_per_slot(num_blocks=132, signallers_per_block=2), 264)


if __name__ == "__main__":
  absltest.main()
