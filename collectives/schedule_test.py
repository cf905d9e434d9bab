"""The all-gather ring schedule, simulated in Python for ring sizes 1 to 8."""

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
      self.assertEqual([schedule.step_of_shard(device, shard, d) for shard in shards],
                       list(range(d)))

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


if __name__ == "__main__":
  absltest.main()
