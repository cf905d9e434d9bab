"""The multi-process launcher on CPU: a real cross-process job, failures and hangs."""

import subprocess
import sys
import time

from absl.testing import absltest, parameterized

from tools import launch


def run_launcher(*args, timeout=300):
  return subprocess.run([sys.executable, "-m", "tools.launch", *args], capture_output=True,
                        text=True, timeout=timeout)


def python(code: str) -> list[str]:
  return [sys.executable, "-c", code]


class LaunchTest(parameterized.TestCase):

  @parameterized.parameters(2, 4)
  def test_all_gather_matmul_across_processes(self, num_processes):
    """The example's portable ring over one CPU device per process, joined through gloo."""
    result = run_launcher(f"--num_processes={num_processes}", "--platform=cpu",
                          "--timeout=240", "--", sys.executable, "-m",
                          "examples.allgather_matmul")
    self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
    for rank in range(num_processes):
      self.assertIn(f"[rank {rank}] process {rank} of {num_processes}", result.stdout)
      self.assertIn(f"[rank {rank}] allgather_matmul: all results match", result.stdout)

  def test_a_failing_rank_stops_the_job_with_its_status(self):
    envs = launch.process_environments(3, use_gpus=False, gpus_per_process=0,
                                       devices_per_process=1)
    code = ("import os, sys, time\n"
            "if os.environ['MGPU_PROCESS_ID'] == '1': sys.exit(3)\n"
            "time.sleep(120)")
    start = time.monotonic()
    status = launch.launch(python(code), envs, timeout_s=100)
    self.assertEqual(status, 3)
    self.assertLess(time.monotonic() - start, 30, "the sleeping ranks were not killed")

  def test_a_hanging_job_is_killed_after_the_timeout(self):
    envs = launch.process_environments(2, use_gpus=False, gpus_per_process=0,
                                       devices_per_process=1)
    start = time.monotonic()
    status = launch.launch(python("import time; time.sleep(120)"), envs, timeout_s=2)
    self.assertEqual(status, launch.TIMEOUT_EXIT_CODE)
    self.assertLess(time.monotonic() - start, 30)

  def test_environments(self):
    envs = launch.process_environments(2, use_gpus=True, gpus_per_process=2,
                                       devices_per_process=1, base_env={"XLA_FLAGS": "--a"})
    self.assertEqual([e["CUDA_VISIBLE_DEVICES"] for e in envs], ["0,1", "2,3"])
    self.assertEqual({e[launch.COORDINATOR_ENV] for e in envs}.pop().split(":")[0], "127.0.0.1")
    cpu = launch.process_environments(1, use_gpus=False, gpus_per_process=0,
                                      devices_per_process=4,
                                      base_env={"XLA_FLAGS": "--a "
                                                "--xla_force_host_platform_device_count=8"})
    self.assertEqual(cpu[0]["XLA_FLAGS"], "--a --xla_force_host_platform_device_count=4")
    self.assertEqual(cpu[0]["JAX_PLATFORMS"], "cpu")

  def test_output_is_prefixed_by_rank(self):
    result = run_launcher("--num_processes=2", "--platform=cpu", "--timeout=60", "--",
                          *python("import os; print('hello from', os.environ['MGPU_PROCESS_ID'])"))
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("[rank 0] hello from 0", result.stdout)
    self.assertIn("[rank 1] hello from 1", result.stdout)

  def test_initialize_outside_a_launch_does_nothing(self):
    self.assertFalse(launch.initialize())


if __name__ == "__main__":
  absltest.main()
