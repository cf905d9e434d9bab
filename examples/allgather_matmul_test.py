"""The main job on CPU as a user runs it: the portable ring, and the Mosaic ring simulated."""

import os
import subprocess
import sys

from absl.testing import absltest

from examples import allgather_matmul

SUCCESS = "allgather_matmul: all results match the float32 reference"


def run_example(*args: str) -> subprocess.CompletedProcess:
  """`python -m examples.allgather_matmul ARGS` with no GPU, in its own process."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # The example asks for its own simulated devices.
  env.pop("PJRT_NPROC", None)  # The simulator sizes XLA's pool itself.
  return subprocess.run([sys.executable, "-m", "examples.allgather_matmul", *args],
                        capture_output=True, text=True, env=env, timeout=240)


class AllGatherMatmulExampleTest(absltest.TestCase):

  def assert_ran(self, result: subprocess.CompletedProcess) -> list[str]:
    output = result.stdout + result.stderr
    self.assertEqual(result.returncode, 0, output)
    self.assertIn(SUCCESS, result.stdout)
    self.assertIn(allgather_matmul.CPU_COLUMNS_NOTE, result.stdout)
    self.assertNotIn("Unable to initialize backend 'tpu'", output)
    self.assertNotIn("Traceback", output)
    return result.stdout.splitlines()

  def test_default_runs_the_portable_ring_on_simulated_devices(self):
    lines = self.assert_ran(run_example())
    self.assertTrue(any(line.startswith("no GPU: the portable XLA ring") for line in lines))
    rows = [line.split() for line in lines if line.split()[:2] in (["1", "xla_ring"],
                                                                   ["8", "xla_ring"])]
    self.assertLen(rows, 2, "\n".join(lines))

  def test_mosaic_runs_the_ring_kernel_in_the_simulator(self):
    lines = self.assert_ran(run_example("--implementation=mosaic"))
    self.assertTrue(any("the Mosaic ring kernel in Mosaic GPU's interpret mode" in line
                        for line in lines), "\n".join(lines))
    rows = [line.split()[:2] for line in lines if line.split()[1:2] == ["mosaic"]]
    self.assertEqual(rows, [[str(d), "mosaic"]
                            for d in allgather_matmul.SIMULATED_DEVICE_COUNTS])
    self.assertIn("race detection: no race between the simulated devices", lines)

  def test_a_size_of_zero_is_refused_not_replaced_by_the_default(self):
    result = run_example("--m_shard=0")
    self.assertEqual(result.returncode, 1, result.stdout)
    self.assertIn("flag --m_shard=0: 0 is not a positive integer", result.stderr)

  def test_help_exits_zero(self):
    result = run_example("--help")
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("--implementation", result.stdout)


if __name__ == "__main__":
  absltest.main()
