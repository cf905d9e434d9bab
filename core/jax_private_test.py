"""Tests of the adapter to jax's private APIs: the version guard, and each door on jax 0.11.2."""

from unittest import mock

import jax
from absl.testing import absltest, parameterized

from core import interpret, jax_private


class VersionGuardTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("reset_gpu_interpreter", jax_private.reset_gpu_interpreter),
      ("last_kernel_races_found", jax_private.last_kernel_races_found),
      ("recorded_race_states", lambda: jax_private.recorded_race_states().__enter__()),
      ("mosaic_gpu_pallas_call", jax_private.mosaic_gpu_pallas_call),
      ("nvshmem_available", jax_private.nvshmem_available),
      ("artificial_shared_memory_limit",
       lambda: jax_private.artificial_shared_memory_limit(0)),
      ("detach_coordination_service", jax_private.detach_coordination_service),
      ("copy_one_segment_tiles_as_boxes", jax_private.copy_one_segment_tiles_as_boxes),
  )
  def test_other_jax_versions_are_refused_by_name(self, call):
    with mock.patch.object(jax, "__version__", "0.12.0"), self.assertRaisesRegex(
        NotImplementedError,
        r"private APIs of jax 0\.11\.2; the installed jax is 0\.12\.0\. Port "
        r"core/jax_private\.py to it \(or pin jax==0\.11\.2\)"):
      call()

  def test_the_pinned_version_is_the_installed_one(self):
    self.assertEqual(jax.__version__, jax_private.PINNED_JAX_VERSION,
                     "requirements/*.lock.txt and core/jax_private.py disagree")
    jax_private.check_jax_version()


class DoorsTest(absltest.TestCase):

  def test_race_state_recording_yields_a_list(self):
    # Kernels recorded in it: core_test's race log test.
    with jax_private.recorded_race_states() as states:
      self.assertEqual(states, [])

  def test_interpreter_state_can_be_read_and_reset(self):
    jax_private.reset_gpu_interpreter()
    self.assertIsInstance(jax_private.last_kernel_races_found(), bool)
    self.assertIsInstance(interpret.races_found(), bool)

  def test_no_coordination_service_outside_a_distributed_job(self):
    self.assertIsNone(jax_private.detach_coordination_service())

  def test_shared_memory_limit_is_a_context_manager(self):
    with jax_private.artificial_shared_memory_limit(1024):
      pass


if __name__ == "__main__":
  absltest.main()
