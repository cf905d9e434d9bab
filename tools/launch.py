"""Runs one program as N processes on this host, joined by `jax.distributed`.

    python -m tools.launch --num_processes=4 -- python -m examples.allgather_matmul
    bazel run //tools:launch -- --num_processes=2 -- python -m examples.allgather_matmul

Every process gets MGPU_COORDINATOR (a free port on 127.0.0.1), MGPU_NUM_PROCESSES
and MGPU_PROCESS_ID; the program calls `tools.launch.initialize()` first, which
joins the job (and does nothing outside a launch). On a GPU host each process
sees `--gpus_per_process` GPUs (CUDA_VISIBLE_DEVICES); on a CPU host (or with
`--platform=cpu`) it gets `--devices_per_process` CPU devices and gloo for
cross-process collectives.

Each output line is prefixed with `[rank i]`. When a process fails, the others
are killed and the launcher exits with its status; when any process is still
running after `--timeout` seconds, all are killed and it exits with 124.
"""

from __future__ import annotations

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

COORDINATOR_ENV = "MGPU_COORDINATOR"
NUM_PROCESSES_ENV = "MGPU_NUM_PROCESSES"
PROCESS_ID_ENV = "MGPU_PROCESS_ID"
TIMEOUT_EXIT_CODE = 124
# Time a process gets to exit after SIGTERM before it is killed.
TERMINATE_GRACE_S = 5.0

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Processes to start.")
_PLATFORM = flags.DEFINE_enum("platform", "auto", ["auto", "gpu", "cpu"],
                              "auto: GPUs when nvidia-smi lists any, else CPU devices.")
_GPUS_PER_PROCESS = flags.DEFINE_integer("gpus_per_process", 1, "GPUs each process sees.")
_DEVICES_PER_PROCESS = flags.DEFINE_integer("devices_per_process", 1,
                                            "CPU devices each process gets (CPU platform).")
_TIMEOUT = flags.DEFINE_float("timeout", 600.0, "Seconds before every process is killed.")


def initialize() -> bool:
  """Joins the job this process was launched into; returns False outside a launch.

  Call before any other JAX call that touches devices.
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
  return True


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


def process_environments(num_processes: int, *, use_gpus: bool, gpus_per_process: int,
                         devices_per_process: int, base_env=None) -> list[dict[str, str]]:
  """The environment of each process of a launch."""
  base = dict(os.environ if base_env is None else base_env)
  coordinator = f"127.0.0.1:{_free_port()}"
  envs = []
  for rank in range(num_processes):
    env = dict(base)
    env.update({COORDINATOR_ENV: coordinator, NUM_PROCESSES_ENV: str(num_processes),
                PROCESS_ID_ENV: str(rank)})
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


def _stop(procs: Sequence[subprocess.Popen]) -> None:
  """SIGTERM to every live process group, then SIGKILL to the ones still alive."""
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
  deadline = time.monotonic() + TERMINATE_GRACE_S
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()


def launch(command: Sequence[str], envs: Sequence[dict[str, str]], *, timeout_s: float) -> int:
  """Runs `command` once per environment; returns the job's exit status."""
  lock = threading.Lock()
  procs, readers = [], []
  for rank, env in enumerate(envs):
    # Own process group each, so that a kill reaches the program's children.
    p = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    procs.append(p)
    reader = threading.Thread(target=_forward_output, args=(rank, p.stdout, lock), daemon=True)
    reader.start()
    readers.append(reader)
  deadline = time.monotonic() + timeout_s
  status = 0
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        rank, status = failed[0]
        print(f"launch: rank {rank} exited with status {status}; stopping the others",
              file=sys.stderr)
        break
      if all(c == 0 for c in codes):
        break
      if time.monotonic() > deadline:
        running = [rank for rank, c in enumerate(codes) if c is None]
        print(f"launch: ranks {running} still running after {timeout_s:g} s; killing the job",
              file=sys.stderr)
        status = TIMEOUT_EXIT_CODE
        break
      time.sleep(0.05)
  finally:
    _stop(procs)
    for reader in readers:
      reader.join(timeout=TERMINATE_GRACE_S)
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
  sys.exit(launch(command, envs, timeout_s=_TIMEOUT.value))


if __name__ == "__main__":
  app.run(main)
