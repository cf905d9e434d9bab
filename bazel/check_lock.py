"""Checks that the running interpreter matches a lock file.

Usage: python check_lock.py requirements/cpu.lock.txt

Exits 0 when the interpreter is Python >= 3.12 and every `name==version` line of the lock
file is installed at exactly that version; otherwise prints what differs and exits 1.
bazel/python.bzl runs it after installing a lock file, and to decide whether an interpreter
given through MGPU_PYTHON can be used as it is.
"""

import importlib.metadata
import re
import sys

MIN_PYTHON = (3, 12)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: str) -> dict[str, str]:
    pins = {}
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;]+)", line)
            if not match:
                raise SystemExit(f"{path}: not an exact pin (name==version): {raw.rstrip()}")
            pins[_normalize(match.group(1))] = match.group(3)
    return pins


def mismatches(pins: dict[str, str]) -> list[str]:
    problems = []
    if sys.version_info[:2] < MIN_PYTHON:
        problems.append(f"Python {sys.version.split()[0]} < {'.'.join(map(str, MIN_PYTHON))}")
    for name, want in sorted(pins.items()):
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{name}: not installed (lock file: {want})")
            continue
        if have != want:
            problems.append(f"{name}: {have} installed, lock file: {want}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    problems = mismatches(read_pins(argv[1]))
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
