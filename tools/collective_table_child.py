"""Measures one row of the collective table and writes it as JSON.

    python -m tools.collective_table_child --devices=2 --m_shard=1024 --k=4096 \
        --n_shard=4096 --dtype=float16 --config= --implementation=auto \
        --iterations=50 --row_json=/tmp/row.json

`collective_table.measure_rows` starts one such process per row on a GPU host,
with CUDA_VISIBLE_DEVICES set to the row's devices (`collective_table.child_argv`
builds the command line); the row runs on every device the process sees.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from pipelines import TuningConfig
from tools import cli, collective_table


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The flags `collective_table.child_argv` writes; all are required."""
  parser = argparse.ArgumentParser(description="Measures one row of the collective table.")
  for name in ("devices", "m_shard", "k", "n_shard", "iterations"):
    parser.add_argument(f"--{name}", type=int, required=True)
  for name in ("dtype", "op", "config", "implementation", "row_json"):
    parser.add_argument(f"--{name}", required=True)
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
  a = parse_args(argv)
  config = cli.parse_config(TuningConfig, a.config) if a.config else None
  problem = collective_table.LocalProblem(m_shard=a.m_shard, k=a.k, n_shard=a.n_shard,
                                          dtype=a.dtype, op=a.op)
  row = collective_table.measure_row(a.devices, problem, config=config,
                                     implementation=a.implementation,
                                     iterations=a.iterations)
  with open(a.row_json, "w") as f:
    json.dump(row, f)


if __name__ == "__main__":
  main()
