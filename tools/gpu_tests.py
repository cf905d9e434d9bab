"""Runs the repo's test files on a GPU host, in parallel pytest processes: `gpu_check.sh tests`.

A GPU test's time is mostly compiling its kernels on the CPU, so one process at a time
leaves all but one core idle. This runner starts up to `--jobs` pytest processes at once
(MGPU_TEST_BACKEND=gpu, every process on the same GPUs, none preallocating GPU memory),
each on one test file or on a shard of its cases (`conftest.py`'s `--shard=I/N`). How many
shards a file gets, and which jobs start first, come from the per-file times of its cases in
a recorded run (`TIMES_FILE`, rewritten with `--record_times`): longest first, so the
slowest file does not start last. The shards of a file are dealt by the recorded time of
each case (`--shard_times`), so that they take about the same time.

Every case that ran before still runs; a case that needs more GPUs than the host has skips
and says why. The run fails if any case fails or errors, or if a job outlives
`--job_timeout_s` (it is killed and reported, never retried). Results: one log and one
JUnit XML per job under `--out_dir`, `gpu_tests.json` (each job's wall time and counts,
each case's duration) and a table printed last.

    python3 tools/gpu_tests.py --out_dir=out [--jobs=16] [paths or pytest args after --]

Uses only the standard library: it never imports jax, so it starts no GPU client itself.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import heapq
import json
import math
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The packages whose test files run on a GPU host (the same set Bazel's GPU twins and
# the CPU-only tests come from; simulator/ and bazel/ test the CPU environment).
PACKAGES = ("core", "pipelines", "collectives", "tools", "examples")
# Per-file sums of the case times (seconds) of a recorded run on one H200 with 16 jobs at
# once: what the file's cases take, however many shards ran them.
TIMES_FILE = ROOT / "tools" / "gpu_test_times.json"
# A file is split into shards of about one of these many seconds of its recorded case
# time, whichever the plan expects to end first: each process repeats the imports, the GPU
# client and the collection (`JOB_START_S`), so small shards waste time, and large ones
# can leave a few slots running long after the others. Replayed from the case times of
# the run of 2026-12-05 (16 at once), one fixed size gave from 464 to 578 s across
# 70-200 s shards: which size packs best depends on the files' times.
SHARD_TARGETS_S = (60.0, 80.0, 100.0, 125.0, 150.0, 175.0, 200.0, 250.0)
# A process's start before its first case (4-13 s, median 9, on 2026-12-05).
JOB_START_S = 9.0
# What a file missing from TIMES_FILE is assumed to take.
UNRECORDED_FILE_S = 30.0
# pytest's exit codes that are not failures: all passed (or skipped); a shard that
# collected no case.
PYTEST_OK, PYTEST_NO_TESTS = 0, 5


@dataclasses.dataclass(frozen=True)
class Job:
  """One pytest process: `path`, or its cases `shard`, `shard + shards`, ..."""

  path: str
  shard: int
  shards: int
  expected_s: float

  @property
  def name(self) -> str:
    stem = self.path.removesuffix(".py").replace("/", ".")
    return stem if self.shards == 1 else f"{stem}.{self.shard}of{self.shards}"


@dataclasses.dataclass
class JobResult:
  job: Job
  returncode: int
  wall_s: float
  timed_out: bool
  counts: dict[str, int]
  cases: list[dict]

  @property
  def failed(self) -> bool:
    return (self.timed_out or self.counts["failures"] + self.counts["errors"] > 0
            or self.returncode not in (PYTEST_OK, PYTEST_NO_TESTS))


def test_files(paths: list[str]) -> list[str]:
  """The `*_test.py` files under `paths` (default `PACKAGES`), relative to the repo root."""
  found = []
  for path in paths or PACKAGES:
    full = ROOT / path
    candidates = [full] if full.is_file() else sorted(full.glob("*_test.py"))
    found.extend(str(p.relative_to(ROOT)) for p in candidates)
  return found


def recorded_times() -> dict[str, float]:
  """Each test file's recorded case time (seconds), by path."""
  if not TIMES_FILE.exists():
    return {}
  return json.loads(TIMES_FILE.read_text())["file_case_s"]


def has_case_times() -> bool:
  """Whether `TIMES_FILE` records each case's time, for `--shard_times`."""
  return TIMES_FILE.exists() and bool(json.loads(TIMES_FILE.read_text()).get("case_s"))


def plan(files: list[str], times: dict[str, float], slots: int) -> list[Job]:
  """Jobs for `files` on `slots` processes at once, the longest first: split
  into the shard size of `SHARD_TARGETS_S` that `expected_wall_s` gives the
  earliest end (the fewest jobs of equal ends)."""
  return min((split_files(files, times, target) for target in SHARD_TARGETS_S),
             key=lambda jobs: (expected_wall_s(jobs, slots), len(jobs)))


def expected_wall_s(jobs: list[Job], slots: int) -> float:
  """When `jobs` end, started in order, each on the first free of `slots`
  processes, each taking its expected time and `JOB_START_S`."""
  ends = [0.0] * slots
  for job in jobs:
    heapq.heapreplace(ends, ends[0] + job.expected_s + JOB_START_S)
  return max(ends)


def split_files(files: list[str], times: dict[str, float], target_s: float) -> list[Job]:
  """Jobs for `files`, each split into shards of about `target_s` of its
  recorded time, the longest first."""
  jobs = []
  for path in files:
    seconds = times.get(path, UNRECORDED_FILE_S)
    shards = max(1, math.ceil(seconds / target_s))
    jobs.extend(Job(path, i, shards, seconds / shards) for i in range(shards))
  return sorted(jobs, key=lambda job: (-job.expected_s, job.name))


def job_env(gpu_env: dict[str, str]) -> dict[str, str]:
  env = dict(os.environ)
  env.update(gpu_env)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  return env


def parse_junit(path: Path) -> tuple[dict[str, int], list[dict]]:
  counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
  cases = []
  if not path.exists():
    return counts, cases
  for suite in ET.parse(path).getroot().iter("testsuite"):
    for key in counts:
      counts[key] += int(suite.get(key, 0))
    for case in suite.iter("testcase"):
      outcome = "passed"
      for child in case:
        if child.tag in ("failure", "error", "skipped"):
          outcome = child.tag
      cases.append({"id": f"{case.get('classname')}.{case.get('name')}",
                    "time_s": float(case.get("time", 0)), "outcome": outcome})
  return counts, cases


def run_job(job: Job, *, python: str, out_dir: Path, env: dict[str, str],
            pytest_args: list[str], timeout_s: float, shard_times: Path | None) -> JobResult:
  log_path, junit_path = out_dir / f"{job.name}.log", out_dir / f"{job.name}.xml"
  command = [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
             "-o", "python_files=*_test.py", f"--junitxml={junit_path}", job.path, *pytest_args]
  if job.shards > 1:
    command.append(f"--shard={job.shard}/{job.shards}")
    if shard_times is not None:
      command.append(f"--shard_times={shard_times}")
  start = time.monotonic()
  timed_out = False
  with open(log_path, "w") as log:
    log.write(" ".join(command) + "\n")
    log.flush()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
      returncode = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      timed_out = True
      os.killpg(process.pid, 9)
      returncode = process.wait()
      log.write(f"\nKILLED: still running after {timeout_s:g} s (--job_timeout_s)\n")
  counts, cases = parse_junit(junit_path)
  return JobResult(job, returncode, time.monotonic() - start, timed_out, counts, cases)


def summary_table(results: list[JobResult], wall_s: float, jobs: int) -> str:
  lines = [f"{'job':56} {'wall s':>7} {'tests':>5} {'skip':>5} {'fail':>5}  status"]
  for r in sorted(results, key=lambda r: -r.wall_s):
    status = ("TIMED OUT" if r.timed_out else "FAILED" if r.failed else "ok")
    lines.append(f"{r.job.name:56} {r.wall_s:7.1f} {r.counts['tests']:5d} "
                 f"{r.counts['skipped']:5d} {r.counts['failures'] + r.counts['errors']:5d}  "
                 f"{status}")
  total = {key: sum(r.counts[key] for r in results) for key in results[0].counts}
  busy = sum(r.wall_s for r in results)
  lines.append(f"{len(results)} jobs, {jobs} at a time: {wall_s:.0f} s wall, {busy:.0f} s of "
               f"job time; {total['tests']} cases, {total['skipped']} skipped, "
               f"{total['failures']} failed, {total['errors']} errors")
  return "\n".join(lines)


def file_times(results: list[JobResult]) -> dict[str, float]:
  """Each file's case time: the sum over its cases, whatever the shards (start-up excluded)."""
  by_file: dict[str, float] = {}
  for r in results:
    by_file[r.job.path] = by_file.get(r.job.path, 0.0) + sum(c["time_s"] for c in r.cases)
  return {path: round(seconds, 1) for path, seconds in sorted(by_file.items())}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out_dir", default="out", help="where logs and results go")
  parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                      help="pytest processes at once (default: one per CPU core)")
  parser.add_argument("--job_timeout_s", type=float, default=480.0,
                      help="a job still running after this long is killed and fails")
  parser.add_argument("--python", default=sys.executable, help="the interpreter of the jobs")
  parser.add_argument("--record_times", action="store_true",
                      help=f"rewrite {TIMES_FILE.relative_to(ROOT)} with this run's file times")
  parser.add_argument("paths", nargs="*", help=f"test files or packages (default: {PACKAGES})")
  args, pytest_args = parser.parse_known_args(argv)
  if args.jobs < 1:
    parser.error(f"--jobs={args.jobs} must be at least 1")
  out_dir = Path(args.out_dir).resolve() / "gpu_tests"
  out_dir.mkdir(parents=True, exist_ok=True)
  files = test_files(args.paths)
  if not files:
    parser.error(f"no *_test.py files under {args.paths}")
  jobs = plan(files, recorded_times(), args.jobs)
  env = job_env({"MGPU_TEST_BACKEND": "gpu", "PYTHONUNBUFFERED": "1",
                 # Many processes share each GPU: each takes memory as it needs it.
                 "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
  shard_times = TIMES_FILE if has_case_times() else None
  print(f"{len(files)} test files in {len(jobs)} jobs, {args.jobs} at a time; expected to "
        f"end after {expected_wall_s(jobs, args.jobs):.0f} s", flush=True)
  start = time.monotonic()
  results = []
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    futures = [pool.submit(run_job, job, python=args.python, out_dir=out_dir, env=env,
                           pytest_args=pytest_args, timeout_s=args.job_timeout_s,
                           shard_times=shard_times)
               for job in jobs]
    for future in concurrent.futures.as_completed(futures):
      result = future.result()
      results.append(result)
      status = "FAILED" if result.failed else "ok"
      print(f"[{time.monotonic() - start:6.1f} s] {result.job.name}: {status} "
            f"({result.wall_s:.1f} s, {result.counts['tests']} cases)", flush=True)
  wall_s = time.monotonic() - start
  record = {"wall_s": round(wall_s, 1), "jobs_at_once": args.jobs,
            "file_case_s": file_times(results),
            "jobs": [{"name": r.job.name, "path": r.job.path, "shard": r.job.shard,
                      "shards": r.job.shards, "wall_s": round(r.wall_s, 1),
                      "returncode": r.returncode, "timed_out": r.timed_out, **r.counts,
                      "cases": r.cases} for r in results]}
  (out_dir.parent / "gpu_tests.json").write_text(json.dumps(record, indent=1))
  if args.record_times:
    measured = (f"{time.strftime('%Y-%m-%d')}, {args.jobs} jobs at once, "
                "tools/gpu_check.sh tests (each file's and each case's time)")
    case_s = {case["id"]: case["time_s"] for r in results for case in r.cases}
    TIMES_FILE.write_text(json.dumps({"measured": measured, "file_case_s": record["file_case_s"],
                                      "case_s": dict(sorted(case_s.items()))},
                                     indent=1) + "\n")
  print(summary_table(results, wall_s, args.jobs))
  for r in results:
    if r.failed:
      print(f"FAILED: {r.job.name} (log: {out_dir / (r.job.name + '.log')})")
  return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
  sys.exit(main())
