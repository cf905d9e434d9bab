"""Command-line pieces shared by the tools and examples: shapes, configs, operands,
where results go, and `run`, the entry point of every absl program here."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence

# Set by `bazel run` to the directory the user ran Bazel from; the program itself runs in
# its runfiles folder, which Bazel may delete at the next build.
WORKING_DIRECTORY_ENV = "BUILD_WORKING_DIRECTORY"
# absl's flags that print help and exit (with status 1: absl's choice, not an error here).
HELP_FLAGS = frozenset({"help", "?", "helpshort", "helpfull", "helpxml"})
# jax tries every backend it knows on start and logs, at info level, each one that is not
# installed. Only the TPU one is certain here (no libtpu), and it reads like a failure.
JAX_BACKEND_LOGGER = "jax._src.xla_bridge"
TPU_ABSENT_MESSAGE = "Unable to initialize backend 'tpu'"


def parse_shape(text: str, rank: int = 3) -> tuple[int, ...]:
  """"4096x1024x8192" -> (4096, 1024, 8192); raises ValueError naming the text."""
  try:
    dims = tuple(int(x) for x in text.lower().split("x"))
  except ValueError:
    dims = ()
  if len(dims) != rank or min(dims) < 1:
    raise ValueError(f"shape {text!r} must be {rank} positive integers joined by 'x'")
  return dims


def parse_bool(text: str, *, error: str) -> bool:
  """A flag's or field's boolean, "true" or "false" (any case); anything else
  raises ValueError with `error` (what was expected, and where)."""
  if text.lower() not in ("true", "false"):
    raise ValueError(f"{error}, not {text!r}")
  return text.lower() == "true"


def parse_config[T](cls: type[T], text: str) -> T:
  """Builds dataclass `cls` from "field=value,...": ints, booleans ("true" or
  "false") and enum members by name, each as the field's default is typed."""
  return cls(**parse_fields(cls, text))


def parse_fields(cls: type, text: str) -> dict:
  """The fields "field=value,..." names, as keyword arguments of dataclass
  `cls` (typed as `parse_config` types them), for `dataclasses.replace`."""
  types = {f.name: f.type for f in dataclasses.fields(cls)}
  defaults = cls()
  kwargs = {}
  for item in filter(None, text.split(",")):
    name, _, value = item.partition("=")
    if name not in types:
      raise ValueError(f"{cls.__name__} has no field {name!r}; fields: {sorted(types)}")
    current = getattr(defaults, name)
    if isinstance(current, enum.Enum):
      kwargs[name] = type(current)[value]
    elif isinstance(current, bool):  # Before int: a bool is an int.
      kwargs[name] = parse_bool(
          value, error=f"{cls.__name__}.{name} is a bool: give {name}=true or {name}=false")
    else:
      kwargs[name] = int(value)
  return kwargs


def random_operands(m: int, k: int, n: int, dtype, *, seed: int = 0):
  """Random normal lhs (m, k) and rhs (k, n) of `dtype` (never zeros)."""
  import jax  # Late: the launcher imports this module and never imports JAX.
  import jax.numpy as jnp

  lhs = jax.random.normal(jax.random.key(seed), (m, k), jnp.float32).astype(dtype)
  rhs = jax.random.normal(jax.random.key(seed + 1), (k, n), jnp.float32).astype(dtype)
  return lhs, rhs


def user_path(path: str, environ=None) -> str:
  """`path` as the user meant it, absolute.

  A relative path is relative to the directory the user ran the command from:
  under `bazel run` that is BUILD_WORKING_DIRECTORY, not the runfiles folder the
  program runs in; otherwise the current directory. `~` is expanded.
  """
  environ = os.environ if environ is None else environ
  path = os.path.expanduser(path)
  base = environ.get(WORKING_DIRECTORY_ENV) or os.getcwd()
  return os.path.normpath(os.path.join(base, path))


def output_dir(path: str, environ=None) -> str:
  """The directory of an --out_dir flag (see `user_path`), created; absolute."""
  directory = user_path(path, environ)
  os.makedirs(directory, exist_ok=True)
  return directory


def say_written(paths: Iterable[str]) -> list[str]:
  """Prints where the results went: each of `paths` that exists. Returns those."""
  written = [p for p in paths if os.path.exists(p)]
  for path in written:
    print(f"wrote {path}")
  return written


class _DropMessage(logging.Filter):
  """Drops the records whose message starts with a given text."""

  def __init__(self, prefix: str):
    super().__init__()
    self.prefix = prefix

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(self.prefix)


def quiet_absent_tpu() -> None:
  """Drops jax's "Unable to initialize backend 'tpu'" line; every other line stays.

  Idempotent. The logger filters what is logged to it directly, which is where
  jax logs that line.
  """
  logger = logging.getLogger(JAX_BACKEND_LOGGER)
  if not any(isinstance(f, _DropMessage) and f.prefix == TPU_ABSENT_MESSAGE
             for f in logger.filters):
    logger.addFilter(_DropMessage(TPU_ABSENT_MESSAGE))


def asks_for_help(argv: Sequence[str]) -> bool:
  """Whether a command line holds one of absl's help flags (before a `--`)."""
  for arg in argv[1:]:
    if arg == "--":
      return False
    if arg.startswith("-"):
      name, _, value = arg.lstrip("-").partition("=")
      if name in HELP_FLAGS and value.lower() not in ("0", "false"):
        return True
  return False


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, except that printing the help asked for exits 0, not 1."""
  from absl import app

  try:
    return app.parse_flags_with_usage(argv)
  except SystemExit as e:
    if e.code == 1 and asks_for_help(argv):
      sys.exit(0)
    raise


def run(main: Callable[[list[str]], object], argv: list[str] | None = None) -> None:
  """`absl.app.run(main)` for the programs here: `--help` exits 0, and jax's line about an
  absent TPU is not printed. A bad flag still exits 1."""
  from absl import app

  quiet_absent_tpu()
  app.run(main, argv=argv, flags_parser=_parse_flags)
