"""The multi-process launcher on CPU: a real cross-process job, failures and hangs."""

import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from unittest import mock

from absl.testing import absltest, parameterized

from tools import launch


def _runfile(path: str) -> str:
  return os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], path)


def run_launcher(*args, timeout=300):
  return subprocess.run([sys.executable, "-m", "tools.launch", *args], capture_output=True,
                        text=True, timeout=timeout)


def python(code: str) -> list[str]:
  return [sys.executable, "-c", code]


# Bounds of the process-group tests: every wait below ends well within seconds.
WAIT_S = 20.0
GRACE_S = 0.5

# A rank program's helpers: `spawn(name, ignore_term)` starts a child that
# sleeps (ignoring SIGTERM if asked) and returns once the child has written its
# pid, and so has its signal disposition, to PID_DIR/<name>.pid; `record(name)`
# writes this process's pid.
RANK_PRELUDE = textwrap.dedent("""\
    import os, signal, subprocess, sys, time
    PID_DIR = sys.argv[1]
    RANK = os.environ["MGPU_PROCESS_ID"]
    def record(name):
      path = os.path.join(PID_DIR, name + ".pid")
      with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
      os.rename(path + ".tmp", path)
    def spawn(name, ignore_term=False):
      code = ("import os, signal, sys, time\\n"
              + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" if ignore_term else "")
              + "path = os.path.join(sys.argv[1], sys.argv[2] + '.pid')\\n"
              + "open(path + '.tmp', 'w').write(str(os.getpid()))\\n"
              + "os.rename(path + '.tmp', path)\\n"
              + "time.sleep(60)\\n")
      subprocess.Popen([sys.executable, "-c", code, PID_DIR, name])
      while not os.path.exists(os.path.join(PID_DIR, name + ".pid")):
        time.sleep(0.01)
    """)


def rank_program(body: str, pid_dir: str) -> list[str]:
  return [sys.executable, "-c", RANK_PRELUDE + textwrap.dedent(body), pid_dir]


def pid_alive(pid: int) -> bool:
  """Whether `pid` runs (a zombie, dead but not reaped, does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      stat_line = f.read()
  except FileNotFoundError:
    return False
  return stat_line[stat_line.rindex(")") + 2] != "Z"


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

  def test_initialize_registers_the_runtime_shutdown_at_exit(self):
    env = launch.process_environments(1, use_gpus=False, gpus_per_process=0,
                                      devices_per_process=1)[0]
    import jax

    with mock.patch.dict(os.environ, env), \
        mock.patch.object(jax.distributed, "initialize") as initialize, \
        mock.patch.object(jax.config, "update"), \
        mock.patch("atexit.register") as register:
      self.assertTrue(launch.initialize())
    initialize.assert_called_once()
    register.assert_called_once_with(launch.shutdown)

  def test_rank_0_stops_the_service_last(self):
    # The order a clean GPU run needs to end without gRPC errors: the client
    # leaves, the peers exit, warnings go off (rank 0's own GPU client still
    # watches the service and would log its stop), and only then the service
    # stops.
    import jax

    from core import jax_private

    calls = mock.Mock()
    service = calls.service
    with mock.patch.object(jax_private, "detach_coordination_service", return_value=service), \
        mock.patch.object(jax.distributed, "shutdown", calls.client_shutdown), \
        mock.patch.object(launch, "_wait_for_peers_to_exit", calls.wait_for_peers), \
        mock.patch.object(jax.config, "update", calls.config_update):
      launch.shutdown()
    self.assertEqual([name for name, *_ in calls.mock_calls],
                     ["client_shutdown", "wait_for_peers", "config_update", "service.shutdown"])
    calls.config_update.assert_called_once_with("jax_logging_level", "ERROR")


class CommandTest(absltest.TestCase):
  """What the launcher runs: the pinned interpreter for `python`, with the launcher's imports."""

  def test_bare_python_is_the_launchers_interpreter(self):
    for name in ("python", "python3"):
      self.assertEqual(launch.resolve_command([name, "-m", "examples.x"]),
                       [sys.executable, "-m", "examples.x"])
    for command in (["/usr/bin/python3", "-c", "1"], ["python3.11", "-c", "1"], ["sh", "-c", "1"]):
      self.assertEqual(launch.resolve_command(command), command)

  def test_child_path_starts_with_the_launchers_workspace(self):
    path = launch.child_python_path({"PYTHONPATH": os.pathsep.join(["/a", launch.WORKSPACE_ROOT])})
    self.assertEqual(path.split(os.pathsep), [launch.WORKSPACE_ROOT, "/a"])
    self.assertTrue(os.path.isfile(os.path.join(launch.WORKSPACE_ROOT, "tools", "launch.py")))
    env = launch.process_environments(1, use_gpus=False, gpus_per_process=0,
                                      devices_per_process=1, base_env={})[0]
    self.assertEqual(env["PYTHONPATH"], launch.WORKSPACE_ROOT)


class BazelRunTest(absltest.TestCase):
  """The docs' command, `bazel run //tools:launch -- ... -- python -m examples.allgather_matmul`.

  Under Bazel it runs the binary's own stub from the runfiles, in the runfiles'
  workspace folder and without this test's PYTHONPATH, as `bazel run` does;
  outside Bazel, `python -m tools.launch` from an empty folder with only the
  checkout on PYTHONPATH. Either way a `python` first on PATH that is not the
  pinned interpreter fails the job if the launcher runs it.
  """

  def test_readme_command_runs_the_example_under_the_pinned_interpreter(self):
    wrong_python = self.create_tempdir("wrong_python")
    fake = wrong_python.create_file("python", "#!/bin/sh\necho wrong python >&2\nexit 97\n")
    os.chmod(fake.full_path, 0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RUNFILES_DIR", "RUNFILES_MANIFEST_FILE",
                        "PYTHON_RUNFILES")}
    env["PATH"] = wrong_python.full_path + os.pathsep + env.get("PATH", "")
    if "TEST_SRCDIR" in os.environ:
      launcher, cwd = [_runfile("tools/launch")], _runfile("")
      env["BUILD_WORKING_DIRECTORY"] = self.create_tempdir("user").full_path
    else:
      launcher, cwd = [sys.executable, "-m", "tools.launch"], self.create_tempdir().full_path
      env["PYTHONPATH"] = launch.WORKSPACE_ROOT
    result = subprocess.run(
        [*launcher, "--num_processes=2", "--platform=cpu", "--timeout=240", "--",
         "python", "-m", "examples.allgather_matmul"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    self.assertEqual(result.returncode, 0, output)
    self.assertNotIn("wrong python", output)
    for rank in range(2):
      self.assertIn(f"[rank {rank}] allgather_matmul: all results match", result.stdout)


class ProcessGroupTest(parameterized.TestCase):
  """What the launcher kills: real processes, each test bounded to seconds."""

  def setUp(self):
    super().setUp()
    self.pid_dir = self.create_tempdir().full_path
    self.addCleanup(self._kill_recorded)
    self.enter_context(mock.patch.object(launch, "TERMINATE_GRACE_S", GRACE_S))

  def _pids(self) -> dict[str, int]:
    return {name.removesuffix(".pid"): int(open(os.path.join(self.pid_dir, name)).read())
            for name in os.listdir(self.pid_dir) if name.endswith(".pid")}

  def _kill_recorded(self):
    """Whatever a failing test left running, by the pids it recorded."""
    for pid in self._pids().values():
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass

  def _wait_for_pids(self, names):
    deadline = time.monotonic() + WAIT_S
    while not set(names) <= set(self._pids()):
      self.assertLess(time.monotonic(), deadline, f"{names} never started: {self._pids()}")
      time.sleep(0.02)

  def assert_all_gone(self, names):
    self.assertEqual(set(self._pids()), set(names), "the test's processes did not all start")
    # Killed processes need a moment to be reaped.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(map(pid_alive, self._pids().values())):
      time.sleep(0.02)
    alive = {name: pid for name, pid in self._pids().items() if pid_alive(pid)}
    self.assertEqual(alive, {}, "processes outlived the launcher")

  @parameterized.parameters(signal.SIGTERM, signal.SIGINT)
  def test_a_stop_signal_to_the_launcher_kills_every_rank_and_its_children(self, sig):
    body = """\
        record("rank" + RANK)
        spawn("child" + RANK)
        time.sleep(60)
        """
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tools.launch", "--num_processes=2", "--platform=cpu",
         "--timeout=60", "--", *rank_program(body, self.pid_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    self.addCleanup(launcher.kill)
    self._wait_for_pids(["rank0", "rank1", "child0", "child1"])
    launcher.send_signal(sig)
    _, stderr = launcher.communicate(timeout=WAIT_S)
    self.assertEqual(launcher.returncode, 128 + sig, stderr)
    self.assertIn(f"got {signal.Signals(sig).name}", stderr)
    self.assert_all_gone(["rank0", "rank1", "child0", "child1"])

  def test_children_of_an_exited_rank_are_killed(self):
    # The rank leaves a child that ignores SIGTERM and exits cleanly.
    body = """\
        spawn("child", ignore_term=True)
        """
    envs = launch.process_environments(1, use_gpus=False, gpus_per_process=0,
                                       devices_per_process=1)
    start = time.monotonic()
    self.assertEqual(launch.launch(rank_program(body, self.pid_dir), envs, timeout_s=WAIT_S), 0)
    self.assertLess(time.monotonic() - start, WAIT_S)
    self.assert_all_gone(["child"])

  def test_a_term_ignoring_child_of_a_stopped_rank_is_killed(self):
    # The rank itself exits on SIGTERM; its child does not.
    body = """\
        record("rank")
        spawn("child", ignore_term=True)
        time.sleep(60)
        """
    envs = launch.process_environments(1, use_gpus=False, gpus_per_process=0,
                                       devices_per_process=1)
    status = launch.launch(rank_program(body, self.pid_dir), envs, timeout_s=3)
    self.assertEqual(status, launch.TIMEOUT_EXIT_CODE)
    self.assert_all_gone(["rank", "child"])

  def test_a_rank_killed_by_a_signal_gives_128_plus_the_signal(self):
    code = ("import os, signal, time\n"
            "if os.environ['MGPU_PROCESS_ID'] == '1': os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(60)")
    result = run_launcher("--num_processes=2", "--platform=cpu", "--timeout=60", "--",
                          *python(code), timeout=WAIT_S)
    self.assertEqual(result.returncode, 128 + signal.SIGKILL, result.stderr)
    self.assertIn("rank 1 was killed by SIGKILL (status 137)", result.stderr)

  def test_a_command_that_cannot_run_gives_one_line_and_127(self):
    not_executable = os.path.join(self.pid_dir, "not_executable")
    with open(not_executable, "w") as f:
      f.write("#!/bin/sh\n")
    os.chmod(not_executable, stat.S_IRUSR | stat.S_IWUSR)
    for command in (os.path.join(tempfile.gettempdir(), "no_such_program_here"),
                    not_executable):
      with self.subTest(command=command):
        result = run_launcher("--num_processes=2", "--platform=cpu", "--", command,
                              timeout=WAIT_S)
        self.assertEqual(result.returncode, launch.CANNOT_RUN_EXIT_CODE, result.stderr)
        self.assertEqual(len(result.stderr.splitlines()), 1, result.stderr)
        self.assertIn(f"cannot run {command!r}", result.stderr)


if __name__ == "__main__":
  absltest.main()
