"""Autotuning results as data: the best `TuningConfig` per device, jax version and problem.

The cache is a JSON file (`tuning_cache.json` beside this module by default,
or `MGPU_TUNING_CACHE`), loaded lazily on first lookup. Keys name the GPU
kind, the jax version and the abstract problem, so a result never leaks to a
different GPU, compiler or shape.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib

import jax
import jax.numpy as jnp

from core import device_facts
from pipelines.config import MatmulDimension, Schedule, TuningConfig
from pipelines.operands import MatmulProblem

CACHE_ENV = "MGPU_TUNING_CACHE"
DEFAULT_CACHE = pathlib.Path(__file__).with_name("tuning_cache.json")


def cache_path() -> pathlib.Path:
  return pathlib.Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def cache_key(problem: MatmulProblem, out_dtype, *, device_kind: str | None = None) -> str:
  kind = device_kind or device_facts().name
  return (f"{kind}|jax={jax.__version__}|{problem.m}x{problem.k}x{problem.n}|"
          f"{problem.dtype.name}->{jnp.dtype(out_dtype).name}")


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


@functools.cache
def _load(path: pathlib.Path) -> dict[str, dict]:
  if not path.exists():
    return {}
  with open(path) as f:
    return json.load(f)


def lookup(problem: MatmulProblem, out_dtype) -> TuningConfig | None:
  """The cached config for this problem on this GPU and jax, or None."""
  entry = _load(cache_path()).get(cache_key(problem, out_dtype))
  return None if entry is None else config_from_json(entry["config"])


def store(problem: MatmulProblem, out_dtype, config: TuningConfig, *, median_us: float,
          path: pathlib.Path | None = None) -> None:
  """Records `config` as the winner for `problem` (rewrites the JSON file)."""
  path = path or cache_path()
  entries = dict(_load(path))
  entries[cache_key(problem, out_dtype)] = {"config": config_to_json(config),
                                            "median_us": median_us}
  path.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
  _load.cache_clear()
