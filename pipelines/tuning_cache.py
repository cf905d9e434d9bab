"""Autotuning results as data: the best `TuningConfig` per device, jax version and problem.

The cache is a JSON file (`tuning_cache.json` beside this module by default,
or `MGPU_TUNING_CACHE`), loaded lazily on first lookup and re-read when another
process replaces it. Keys name the GPU kind, the jax version and the abstract
problem, so a result never leaks to a different GPU, compiler or shape.

A cache file that cannot be read, or an entry that is not a valid config, is
logged as a warning (once per file and problem) and `lookup` returns None, so
`matmul()` falls back to its heuristic config instead of failing. `store` may
run in several processes at once: it takes a lock on `<cache>.lock`, merges
into what is on disk then, and replaces the file atomically, so readers never
see a partial file and entries it does not understand are kept as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import pathlib
import tempfile
import threading
from typing import Any

import jax
import jax.numpy as jnp

from core import device_facts
from pipelines.config import MatmulDimension, Schedule, TuningConfig
from pipelines.kernel_call import check_ws_config
from pipelines.operands import NN, MatmulProblem, pad_k

CACHE_ENV = "MGPU_TUNING_CACHE"
DEFAULT_CACHE = pathlib.Path(__file__).with_name("tuning_cache.json")

_log = logging.getLogger(__name__)


class CacheFileError(ValueError):
  """A tuning cache file that is not a JSON object of entries; the message names the file."""


def cache_path() -> pathlib.Path:
  return pathlib.Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def cache_key(problem: MatmulProblem, out_dtype, *, device_kind: str | None = None) -> str:
  """GPU, jax version, shape, dtypes and, for transposed operands, the layout
  ("|TN", "|NT", "|TT"; none for the plain "NN", so older keys still hold)."""
  kind = device_kind or device_facts().name
  layout = "" if problem.layout == NN else f"|{problem.layout.name}"
  return (f"{kind}|jax={jax.__version__}|{problem.m}x{problem.k}x{problem.n}|"
          f"{problem.dtype.name}->{jnp.dtype(out_dtype).name}{layout}")


def config_to_json(config: TuningConfig) -> dict:
  d = dataclasses.asdict(config)
  d["grid_minor_dim"] = config.grid_minor_dim.name
  d["wg_dimension"] = config.wg_dimension.name
  d["schedule"] = config.schedule.name
  return d


def config_from_json(d: dict) -> TuningConfig:
  d = dict(d)
  d["grid_minor_dim"] = MatmulDimension[d["grid_minor_dim"]]
  d["wg_dimension"] = MatmulDimension[d["wg_dimension"]]
  # Entries from before schedules existed are cooperative.
  d["schedule"] = Schedule[d.get("schedule", Schedule.COOPERATIVE.name)]
  return TuningConfig(**d)


def _file_id(st: os.stat_result) -> tuple[int, ...]:
  # `store` replaces the file, so a rewrite is a new inode even within one
  # mtime tick; size and mtime catch an editor that rewrites in place.
  return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _parse(path: pathlib.Path, text: str) -> dict[str, Any]:
  """The entries of a cache file's `text`; raises `CacheFileError` naming `path`."""
  if not text.strip():
    raise CacheFileError(f"tuning cache {path} is empty; expected a JSON object "
                         "mapping cache keys to entries")
  try:
    entries = json.loads(text)
  except json.JSONDecodeError as e:
    raise CacheFileError(f"tuning cache {path} is not valid JSON: {e}") from e
  if not isinstance(entries, dict):
    raise CacheFileError(f"tuning cache {path} holds a JSON {type(entries).__name__}; "
                         "expected a JSON object mapping cache keys to entries")
  return entries


# path -> (file id, entries). Keyed by file id rather than cached forever, so a
# long-lived process sees winners another process stored after its first lookup.
_loaded: dict[pathlib.Path, tuple[tuple[int, ...], dict[str, Any]]] = {}
_warned: set[tuple[str, str]] = set()
_lock = threading.Lock()


def _warn_once(path: pathlib.Path, what: str, message: str) -> None:
  with _lock:
    if (str(path), what) in _warned:
      return
    _warned.add((str(path), what))
  _log.warning("%s", message)


def _load(path: pathlib.Path) -> dict[str, Any]:
  """The entries of the cache file at `path` ({} if there is none).

  A file that cannot be read or parsed is logged (once) and read as empty.
  Readers take no lock: `store` only ever replaces the file whole.
  """
  try:
    st = os.stat(path)
  except FileNotFoundError:
    return {}
  except OSError as e:
    _warn_once(path, "unreadable", f"cannot read tuning cache {path} ({e}); "
               "using heuristic configs")
    return {}
  with _lock:
    cached = _loaded.get(path)
  if cached is not None and cached[0] == _file_id(st):
    return cached[1]
  try:
    with open(path, encoding="utf-8") as f:
      # The id of the file actually read, which may be newer than `st`.
      file_id = _file_id(os.fstat(f.fileno()))
      text = f.read()
  except FileNotFoundError:
    return {}
  except (OSError, UnicodeDecodeError) as e:
    _warn_once(path, "unreadable", f"cannot read tuning cache {path} ({e}); "
               "using heuristic configs")
    return {}
  try:
    entries = _parse(path, text)
  except CacheFileError as e:
    _warn_once(path, "malformed", f"{e}; ignoring it and using heuristic configs")
    entries = {}
  with _lock:
    _loaded[path] = (file_id, entries)
  return entries


def _entry_config(entry: Any) -> TuningConfig:
  """The config of one cache entry; raises `ValueError` saying what is wrong with it."""
  if not isinstance(entry, dict) or "config" not in entry:
    raise ValueError(f"expected an object with a \"config\", got {json.dumps(entry)[:200]}")
  try:
    return config_from_json(entry["config"])
  except KeyError as e:
    raise ValueError(f"config lacks field {e} or names an unknown enum value: "
                     f"{json.dumps(entry['config'])[:200]}") from e
  except (TypeError, ValueError) as e:  # Unknown field, or a config validation rejects.
    raise ValueError(f"invalid config {json.dumps(entry['config'])[:200]}: {e}") from e


def lookup(problem: MatmulProblem, out_dtype, *, has_bias: bool = False) -> TuningConfig | None:
  """The cached config for this problem on this GPU and jax, or None.

  None also when the cache file or this problem's entry is unusable: not a
  config, or one the kernel cannot run on this problem (with a bias, if
  `has_bias`: a hand-edited or stale entry); that is logged as a warning
  naming the file (and the key), once.
  """
  path = cache_path()
  key = cache_key(problem, out_dtype)
  entry = _load(path).get(key)
  if entry is None:
    return None
  try:
    config = _entry_config(entry)
    check_ws_config(config, pad_k(problem, config.tile_k), out_dtype, has_bias=has_bias)
    return config
  except ValueError as e:
    _warn_once(path, f"entry {key}", f"tuning cache {path}: skipping entry {key!r}: {e}; "
               "using the heuristic config")
    return None


@contextlib.contextmanager
def _locked(path: pathlib.Path):
  """Holds an exclusive lock on `<path>.lock`, so stores to `path` merge one at a time."""
  # A sibling file, not `path` itself: `path` is replaced under the lock, and a
  # lock on the replaced inode would not exclude the next writer.
  with open(path.with_name(path.name + ".lock"), "a") as lock_file:
    fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _merge_into(path: pathlib.Path, new_entries: dict[str, Any]) -> None:
  """Adds `new_entries` to the cache file at `path`, keeping every other entry as it is.

  Raises `OSError` if `path` cannot be written and `CacheFileError` if the file
  there is not a cache (it is then left untouched rather than overwritten).
  """
  # Replace the file a symlink points to, not the link: under `bazel run` the
  # default cache is a runfiles link to the source tree's file.
  path = pathlib.Path(os.path.realpath(path))
  with _locked(path):
    # Re-read under the lock: another process may have stored since our last lookup.
    try:
      text = path.read_text(encoding="utf-8")
      mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
      text, mode = "{}", 0o644
    entries = _parse(path, text)
    entries.update(new_entries)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(entries, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
      os.chmod(tmp, mode)  # mkstemp creates 0600; keep the file readable as before.
      # Atomic: a reader sees the old file or the new one, never a partial write.
      os.replace(tmp, path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.unlink(tmp)
      raise


def fallback_path(path: pathlib.Path) -> pathlib.Path:
  """Where `store` writes when `path` cannot be written: the temp directory."""
  return pathlib.Path(tempfile.gettempdir()) / f"mgpu_{path.name}"


def store(problem: MatmulProblem, out_dtype, config: TuningConfig, *, median_us: float,
          path: pathlib.Path | None = None) -> pathlib.Path:
  """Records `config` as the winner for `problem`; returns the file it went to.

  Safe to call from several processes at once. If `path` (the cache file by
  default) cannot be written (read-only or missing directory) or is not a
  cache file, the entry goes to `fallback_path(path)` instead, with a warning
  naming both; only if that fails too does this raise `OSError`.
  """
  path = pathlib.Path(path or cache_path())
  key = cache_key(problem, out_dtype)
  new = {key: {"config": config_to_json(config), "median_us": median_us}}
  try:
    _merge_into(path, new)
    return path
  except (OSError, CacheFileError) as e:
    error = e
  fallback = fallback_path(path)
  try:
    _merge_into(fallback, new)
  except (OSError, CacheFileError) as e:
    raise OSError(f"could not store tuning cache entry {key!r} in {path} ({error}) nor in "
                  f"{fallback} ({e}); the entry was {json.dumps(new[key])}") from e
  _log.warning("could not store tuning cache entry %r in %s (%s); stored it in %s instead: "
               "copy it into the cache or point %s at that file", key, path, error, fallback,
               CACHE_ENV)
  return fallback
