"""Runs one program as N processes on this host, joined by `jax.distributed`.

    python -m tools.launch --num_processes=4 -- python -m examples.allgather_matmul
    bazel run //tools:launch -- --num_processes=2 -- python -m examples.allgather_matmul

A command that starts with a bare `python` or `python3` runs under the
launcher's own interpreter (`sys.executable`: under `bazel run`, the pinned
one, not the first on PATH), and every process gets the launcher's import path
in PYTHONPATH (under `bazel run`, the runfiles' workspace root and Bazel's
entries), so `python -m examples.x` imports what the launcher can.

Every process gets MGPU_COORDINATOR (a free port on 127.0.0.1), MGPU_NUM_PROCESSES
and MGPU_PROCESS_ID; the program calls `tools.launch.initialize()` first, which
joins the job (and does nothing outside a launch). On a GPU host each process
sees `--gpus_per_process` GPUs (CUDA_VISIBLE_DEVICES); on a CPU host (or with
`--platform=cpu`) it gets `--devices_per_process` CPU devices and gloo for
cross-process collectives.

Each output line is prefixed with `[rank i]`. When a process fails, the others
are killed and the launcher exits with its status (128 + N for a process
killed by signal N); when any process is still running after `--timeout`
seconds, all are killed and it exits with 124; SIGTERM or SIGINT to the
launcher kills all and it exits with 128 + the signal. A command that cannot
be started gives one line on stderr and exit 127.

Each process is started in its own session, and "killed" means its whole
process group, on every way out: SIGTERM, `--terminate_grace` seconds for the
group to exit, then SIGKILL. So a program's own children die with it, even
ones that ignore SIGTERM or outlive the program.

`initialize()` also shuts the job's distributed runtime down in order at
exit, so that a clean run ends without gRPC errors from peers that lost the
coordinator (which rank 0 hosts) while they were still connected.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from absl import app, flags

from tools import cli

COORDINATOR_ENV = "MGPU_COORDINATOR"
NUM_PROCESSES_ENV = "MGPU_NUM_PROCESSES"
PROCESS_ID_ENV = "MGPU_PROCESS_ID"
LAUNCHER_PID_ENV = "MGPU_LAUNCHER_PID"
TIMEOUT_EXIT_CODE = 124
# The shell's status for a command it cannot run.
CANNOT_RUN_EXIT_CODE = 127
# A process killed by signal N exits with 128 + N, as in a shell.
SIGNAL_EXIT_BASE = 128
# Time a process group gets to exit after SIGTERM before it is killed.
TERMINATE_GRACE_S = 5.0
# Signals that stop the launcher and its job (Bazel and CI send SIGTERM).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How often the launcher looks at its processes.
_POLL_S = 0.05
# How long rank 0 keeps the coordination service up for its peers to exit.
PEER_EXIT_WAIT_S = 10.0
# Program names that mean "the launcher's Python" at the head of a command.
PYTHON_NAMES = ("python", "python3")
# The root of the workspace the launcher was imported from (holds `tools/`): in a checkout
# the checkout, under `bazel run` the runfiles' workspace folder.
WORKSPACE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Processes to start.", lower_bound=1)
_PLATFORM = flags.DEFINE_enum("platform", "auto", ["auto", "gpu", "cpu"],
                              "auto: GPUs when nvidia-smi lists any, else CPU devices.")
_GPUS_PER_PROCESS = flags.DEFINE_integer("gpus_per_process", 1, "GPUs each process sees.",
                                         lower_bound=1)
_DEVICES_PER_PROCESS = flags.DEFINE_integer("devices_per_process", 1,
                                            "CPU devices each process gets (CPU platform).",
                                            lower_bound=1)
_TIMEOUT = flags.DEFINE_float("timeout", 600.0, "Seconds before every process is killed.")
_TERMINATE_GRACE = flags.DEFINE_float("terminate_grace", TERMINATE_GRACE_S,
                                      "Seconds between SIGTERM and SIGKILL to a process group.")


def initialize() -> bool:
  """Joins the job this process was launched into; returns False outside a launch.

  Call before any other JAX call that touches devices. Registers the runtime's
  orderly shutdown at exit (`shutdown`).
  """
  if NUM_PROCESSES_ENV not in os.environ:
    return False
  import jax  # Late: the launcher itself never imports JAX.

  if os.environ.get("JAX_PLATFORMS") == "cpu":
    # CPU devices of different processes talk through gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=os.environ[COORDINATOR_ENV],
                             num_processes=int(os.environ[NUM_PROCESSES_ENV]),
                             process_id=int(os.environ[PROCESS_ID_ENV]))
  # atexit runs the last registered first: this runs before jax's own exit
  # hook, which would first tear the backends down under a live runtime.
  atexit.register(shutdown)
  return True


def shutdown() -> None:
  """Leaves the job's distributed runtime; does nothing outside a launch or when left.

  `jax.distributed.shutdown` meets every process at a barrier and disconnects.
  A GPU process's runtime keeps watching the coordination service (which rank
  0 hosts) until the process ends, and logs a gRPC CANCELLED or "connection
  refused" error when the service stops first. So rank 0 stops the service
  only after its peers have exited (up to `PEER_EXIT_WAIT_S`), with warnings
  off for its own client's watch of the service, which outlives it.
  """
  import jax

  # jax.distributed.shutdown stops rank 0's service at once; only its state
  # lets the service be stopped apart from the client.
  from core import jax_private

  service = jax_private.detach_coordination_service()
  jax.distributed.shutdown()
  if service is not None:
    _wait_for_peers_to_exit(PEER_EXIT_WAIT_S)
    # Rank 0's own GPU client watches the service's tasks for as long as the
    # client lives, and JAX keeps it alive to the end of the process (every
    # device object holds it; clearing the backends does not free it). So
    # stopping the service makes that watch log a warning, "WatchTasksAsync
    # failed ... UNAVAILABLE: Cancelling all calls", about a job that has
    # ended in order. Only warnings are silenced, and only from here on.
    jax.config.update("jax_logging_level", "ERROR")
    service.shutdown()


def _process_stat(pid: str) -> tuple[str, int, int] | None:
  """(state, parent pid, process group) of a process per /proc, or None when it is gone."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      stat = f.read()
  except OSError:
    return None
  # Fields after "(command)": state, ppid, pgrp, ...
  state, ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
  return state, int(ppid), int(pgrp)


def _wait_for_peers_to_exit(timeout_s: float) -> None:
  """Waits until no other process of this launch (a child of the launcher) runs."""
  launcher = os.environ.get(LAUNCHER_PID_ENV)
  if launcher is None or not os.path.isdir("/proc"):
    return
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    stats = [_process_stat(pid) for pid in os.listdir("/proc")
             if pid.isdigit() and int(pid) != os.getpid()]
    if not any(stat is not None and stat[1] == int(launcher) and stat[0] != "Z"
               for stat in stats):
      return
    time.sleep(_POLL_S)


def gpu_count() -> int:
  """GPUs on this host per nvidia-smi (0 without the driver)."""
  if shutil.which("nvidia-smi") is None:
    return 0
  try:
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
  except (subprocess.SubprocessError, OSError):
    return 0
  return sum(line.startswith("GPU ") for line in listing.splitlines())


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def resolve_command(command: Sequence[str]) -> list[str]:
  """`command` with a bare `python`/`python3` at its head replaced by `sys.executable`.

  The launcher's interpreter is the one that has the pinned jax (under `bazel
  run`, the toolchain's); the `python` on PATH may be any other. A path
  (`/usr/bin/python3`) or another name is left as given.
  """
  command = list(command)
  if command and command[0] in PYTHON_NAMES and sys.executable:
    command[0] = sys.executable
  return command


def child_python_path(base_env=None) -> str:
  """The PYTHONPATH of every process: the launcher's workspace root, then the existing PYTHONPATH.

  Under `bazel run` the binary's stub has put the runfiles' import roots in
  PYTHONPATH already; the workspace root comes first in any case, so that the
  packages the launcher imports itself (`tools`) are the ones the program sees.
  """
  env = os.environ if base_env is None else base_env
  entries = [WORKSPACE_ROOT] + [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]
  return os.pathsep.join(dict.fromkeys(entries))


def process_environments(num_processes: int, *, use_gpus: bool, gpus_per_process: int,
                         devices_per_process: int, base_env=None) -> list[dict[str, str]]:
  """The environment of each process of a launch."""
  base = dict(os.environ if base_env is None else base_env)
  base["PYTHONPATH"] = child_python_path(base)
  coordinator = f"127.0.0.1:{_free_port()}"
  envs = []
  for rank in range(num_processes):
    env = dict(base)
    env.update({COORDINATOR_ENV: coordinator, NUM_PROCESSES_ENV: str(num_processes),
                PROCESS_ID_ENV: str(rank), LAUNCHER_PID_ENV: str(os.getpid())})
    if use_gpus:
      first = rank * gpus_per_process
      env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(first, first + gpus_per_process)))
    else:
      env["JAX_PLATFORMS"] = "cpu"
      env["XLA_FLAGS"] = " ".join(
          [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
          + [f"--xla_force_host_platform_device_count={devices_per_process}"])
    envs.append(env)
  return envs


def _forward_output(rank: int, stream, lock: threading.Lock) -> None:
  for line in iter(stream.readline, ""):
    with lock:
      sys.stdout.write(f"[rank {rank}] {line}")
      sys.stdout.flush()


def _signal_group(pgid: int, sig: int) -> bool:
  """Sends `sig` to process group `pgid`; False when the group has no process left."""
  try:
    os.killpg(pgid, sig)
  except ProcessLookupError:
    return False
  return True


def _group_alive(pgid: int) -> bool:
  """Whether process group `pgid` has a process that is not a zombie.

  An orphan's zombie waits for whoever adopted it to reap it, which may be
  never (a container's init), and still counts for `killpg`.
  """
  if not _signal_group(pgid, 0):
    return False
  try:
    pids = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
  except OSError:  # No procfs: trust killpg.
    return True
  stats = [_process_stat(pid) for pid in pids]
  return any(stat is not None and stat[2] == pgid and stat[0] != "Z" for stat in stats)


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
  """Stops every process's group: SIGTERM, up to `grace_s` to exit, then SIGKILL.

  A group is signalled whether or not its leader (the process started here)
  is still running: the leader's children may outlive it, and may ignore
  SIGTERM.
  """
  groups = [p.pid for p in procs]  # Each process leads its own group (own session).
  alive = [g for g in groups if _signal_group(g, signal.SIGTERM)]
  deadline = time.monotonic() + grace_s
  while alive and time.monotonic() < deadline:
    for p in procs:
      p.poll()  # Reaps exited leaders, whose zombies would keep their group alive.
    alive = [g for g in alive if _group_alive(g)]
    if alive:
      time.sleep(_POLL_S)
  for g in alive:
    _signal_group(g, signal.SIGKILL)
  for p in procs:
    p.wait()


def exit_status(returncode: int) -> int:
  """A process's exit status as a shell gives it: 128 + N when killed by signal N."""
  return SIGNAL_EXIT_BASE - returncode if returncode < 0 else returncode


def _signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return f"signal {signum}"


def _describe_exit(returncode: int) -> str:
  if returncode < 0:
    return f"was killed by {_signal_name(-returncode)} (status {exit_status(returncode)})"
  return f"exited with status {returncode}"


@contextlib.contextmanager
def _stop_signals_recorded(received: list[int]):
  """Within the block, SIGTERM and SIGINT append their number to `received`.

  The launcher must outlive them to stop its job (by default SIGTERM would end
  it at once and leave every rank running). Only the main thread may set
  signal handlers; elsewhere (a test's thread) the block changes nothing.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
              for sig in _STOP_SIGNALS}
  try:
    yield
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def launch(command: Sequence[str], envs: Sequence[dict[str, str]], *, timeout_s: float,
           grace_s: float | None = None) -> int:
  """Runs `command` once per environment; returns the job's exit status.

  `grace_s`: how long each process group gets between SIGTERM and SIGKILL
  when the job stops (default `TERMINATE_GRACE_S`).
  """
  if grace_s is None:
    grace_s = TERMINATE_GRACE_S
  lock = threading.Lock()
  procs, readers, received = [], [], []
  status = 0
  with _stop_signals_recorded(received):
    try:
      for rank, env in enumerate(envs):
        try:
          # Own session, hence own process group: a kill reaches the program's children.
          p = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
        except OSError as e:
          print(f"launch: cannot run {command[0]!r}: {e.strerror or e}", file=sys.stderr)
          return CANNOT_RUN_EXIT_CODE
        procs.append(p)
        reader = threading.Thread(target=_forward_output, args=(rank, p.stdout, lock),
                                  daemon=True)
        reader.start()
        readers.append(reader)
      deadline = time.monotonic() + timeout_s
      while True:
        if received:
          sig = received[0]
          print(f"launch: got {_signal_name(sig)}; stopping every rank",
                file=sys.stderr)
          status = SIGNAL_EXIT_BASE + sig
          break
        codes = [p.poll() for p in procs]
        failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
        if failed:
          rank, code = failed[0]
          print(f"launch: rank {rank} {_describe_exit(code)}; stopping the others",
                file=sys.stderr)
          status = exit_status(code)
          break
        if all(c == 0 for c in codes):
          break
        if time.monotonic() > deadline:
          running = [rank for rank, c in enumerate(codes) if c is None]
          print(f"launch: ranks {running} still running after {timeout_s:g} s; killing the job",
                file=sys.stderr)
          status = TIMEOUT_EXIT_CODE
          break
        time.sleep(_POLL_S)
    finally:
      # Still under the recorded handlers: a second SIGTERM must not cut this short.
      _stop(procs, grace_s)
      for reader in readers:
        reader.join(timeout=grace_s)
  return status


def main(argv):
  command = argv[1:]
  if command and command[0] == "--":
    command = command[1:]
  if not command:
    raise app.UsageError("give the program to run after --, e.g. -- python -m examples.x")
  num = _NUM_PROCESSES.value
  if num < 1:
    raise app.UsageError(f"--num_processes={num} must be at least 1")
  gpus = gpu_count() if _PLATFORM.value != "cpu" else 0
  use_gpus = _PLATFORM.value == "gpu" or (_PLATFORM.value == "auto" and gpus > 0)
  if use_gpus and num * _GPUS_PER_PROCESS.value > gpus:
    raise app.UsageError(f"--num_processes={num} x --gpus_per_process="
                         f"{_GPUS_PER_PROCESS.value} needs more GPUs than the {gpus} here")
  envs = process_environments(num, use_gpus=use_gpus, gpus_per_process=_GPUS_PER_PROCESS.value,
                              devices_per_process=_DEVICES_PER_PROCESS.value)
  sys.exit(launch(resolve_command(command), envs, timeout_s=_TIMEOUT.value,
                  grace_s=_TERMINATE_GRACE.value))


if __name__ == "__main__":
  cli.run(main)
