"""Developer tasks. `nox -l` lists them; `nox` runs lint and tests.

    nox -s tests        ./bazelw test //...  (CPU tests, lint, consumer workspace)
    nox -s lint         ruff check
    nox -s examples     ./bazelw run //examples:allgather_matmul (the main job)
    nox -s gpu_tests    tools/gpu_tests.py on a GPU machine, with requirements/cuda12.lock.txt

Bazel manages its own Python environment (bazel/python.bzl); only gpu_tests and lint make
virtualenvs of their own.
"""

import re
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CPU_LOCK = ROOT / "requirements" / "cpu.lock.txt"
CUDA12_LOCK = ROOT / "requirements" / "cuda12.lock.txt"

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def _pin(name: str, lock: Path = CPU_LOCK) -> str:
    """`name==version` as pinned in a lock file."""
    for line in lock.read_text().splitlines():
        if re.match(rf"{re.escape(name)}(\[[^\]]*\])?==", line, flags=re.IGNORECASE):
            return line.split("#", 1)[0].strip()
    raise ValueError(f"{name} is not pinned in {lock}")


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """CPU tests with Bazel: ./bazelw test //... [extra bazel args]."""
    session.run(str(ROOT / "bazelw"), "test", "//...", *session.posargs, external=True)


@nox.session(python=False)
def examples(session: nox.Session) -> None:
    """The main job: ./bazelw run //examples:allgather_matmul [-- flags]."""
    session.run(
        str(ROOT / "bazelw"), "run", "//examples:allgather_matmul", *session.posargs,
        external=True,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check (configuration: pyproject.toml); the same check as //:lint_test."""
    session.install(_pin("ruff"))
    session.run("ruff", "check", *(session.posargs or [str(ROOT)]))


@nox.session(python="3.12")
def gpu_tests(session: nox.Session) -> None:
    """All tests on a CUDA 12 GPU machine, without Bazel: tools/gpu_tests.py, in parallel."""
    session.install("-r", str(CUDA12_LOCK))
    session.chdir(ROOT)
    session.run("python", "tools/gpu_tests.py", *session.posargs)
