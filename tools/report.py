"""Benchmark output: aligned text tables and JSON records."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence


def write_json(path: str, records: list[dict]) -> None:
  with open(path, "w") as f:
    json.dump(records, f, indent=1)


def print_table(rows: list[dict], columns: Sequence[str]) -> None:
  """Prints `rows` (dicts) as an aligned text table of `columns`."""
  def fmt(v):
    if isinstance(v, (list, tuple)):  # e.g. a problem's models, or each round's median.
      return ",".join(fmt(x) for x in v)
    if isinstance(v, float):
      return f"{v:.2e}" if 0 < abs(v) < 1e-2 else f"{v:.3f}"
    return str(v)
  cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
  print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
  for row in cells:
    print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def write_plot(plot: Callable[[list[dict], str], None], records: list[dict], path: str) -> None:
  """Draws `plot(records, path)`; says so instead of failing where matplotlib is missing."""
  try:
    plot(records, path)
  except ImportError:
    print(f"matplotlib is not installed: {path} not written")
