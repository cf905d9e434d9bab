"""Command-line pieces shared by the tools and examples: shapes, configs, operands."""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp


def parse_shape(text: str, rank: int = 3) -> tuple[int, ...]:
  """"4096x1024x8192" -> (4096, 1024, 8192); raises ValueError naming the text."""
  try:
    dims = tuple(int(x) for x in text.lower().split("x"))
  except ValueError:
    dims = ()
  if len(dims) != rank or min(dims) < 1:
    raise ValueError(f"shape {text!r} must be {rank} positive integers joined by 'x'")
  return dims


def parse_config[T](cls: type[T], text: str) -> T:
  """Builds dataclass `cls` from "field=value,...": ints, and enum members by name."""
  types = {f.name: f.type for f in dataclasses.fields(cls)}
  defaults = cls()
  kwargs = {}
  for item in filter(None, text.split(",")):
    name, _, value = item.partition("=")
    if name not in types:
      raise ValueError(f"{cls.__name__} has no field {name!r}; fields: {sorted(types)}")
    current = getattr(defaults, name)
    kwargs[name] = type(current)[value] if isinstance(current, enum.Enum) else int(value)
  return cls(**kwargs)


def random_operands(m: int, k: int, n: int, dtype, *, seed: int = 0):
  """Random normal lhs (m, k) and rhs (k, n) of `dtype` (never zeros)."""
  lhs = jax.random.normal(jax.random.key(seed), (m, k), jnp.float32).astype(dtype)
  rhs = jax.random.normal(jax.random.key(seed + 1), (k, n), jnp.float32).astype(dtype)
  return lhs, rhs
