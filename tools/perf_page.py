"""Writes PERFORMANCE.md, the page of current results, from the benchmark records in perf/.

    bazel run //tools:perf_page      # rewrites PERFORMANCE.md and docs/img/perf-*.png

Which records feed which table is data: `perf/manifest.json` lists the tables,
each with the schema of its records (the JSON one of the benchmarks here
writes: `SCHEMAS`), its baseline, the implementations it shows and its
sources, each a record file in perf/ with the date, device and command of the
run that wrote it. A new benchmark run is one more source (or table) there and
a rerun of this tool; the page is never edited by hand, and
`tools/perf_page_test.py` fails when it is not what the records give.

A table of the manifest: `id` (its plot's name), `title`, `schema` (a key of
`SCHEMAS`), `about` and `notes` (text above the table), `baseline` and
`implementations` (the names the records give them, and the implementations'
labels, ours first), `baseline_label`, and `sources`: each a record file
(`json`, in perf/) with the `date`, `device` and `command` of its run, and
optionally `where`, {field: [values]} to keep only some of its records.

Every ratio is the baseline's time over the implementation's, both timed in
the same run (above 1: faster than the baseline), as the benchmarks record
it; a range is over the rounds in which the implementations took turns.
Each table also gets a plot of its ratios, and the page opens with a summary
(the median ratio of each implementation over each table's problems), which
README.md repeats.

The page is written under `--root` (by default the workspace `bazel run` was
started in, else this checkout); `--check` writes nothing and fails where the
page differs from what the records give.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import sys
from collections.abc import Callable

from absl import flags

from tools import cli

MANIFEST = "perf/manifest.json"
PAGE = "PERFORMANCE.md"
PLOT_DIR = "docs/img"
SUMMARY_PLOT = f"{PLOT_DIR}/perf-summary.png"
LOG = "docs/performance-log.md"
# Set by `bazel run` to the workspace it was started in: the page is written
# into the source tree, not into the runfiles the program runs from.
WORKSPACE_ENV = "BUILD_WORKSPACE_DIRECTORY"

_ROOT = flags.DEFINE_string("root", None, "The checkout to read perf/ from and write the page "
                            "into; default: the workspace of `bazel run`, else this checkout.")
_CHECK = flags.DEFINE_bool("check", False, "Write nothing; exit 1 if PERFORMANCE.md is not "
                           "what the records give.")

HEADER = f"""\
# Performance

The latest measurement of each op, against its baseline timed in the same run.
This page is generated from the benchmark records in `perf/` by
`tools/perf_page.py`; `{MANIFEST}` says which record feeds which table. To add a
run, add its JSON to `perf/` and a source (or a table) to the manifest, then run
`./bazelw run //tools:perf_page`. What was tried on the way, and what did not
help, is the dated log in [`{LOG}`]({LOG}).

Each ratio is the baseline's time over ours (above 1: faster than the baseline);
a range in parentheses is over the rounds in which the implementations took
turns. Times are CUPTI medians of many calls after warm-up (`core/timing.py`),
on random normal data; every output was checked against a float32 reference.
Each table names the device it ran on: an NVIDIA H200 SXM unless it says H100.
"""


@dataclasses.dataclass(frozen=True)
class Source:
  """One record file and the run that wrote it."""

  json: str  # A file name in perf/.
  date: str
  device: str
  command: str
  # Keeps only the records whose field has one of these values (e.g. one pass).
  where: tuple[tuple[str, tuple], ...] = ()

  def keeps(self, record: dict, default: dict) -> bool:
    return all(record.get(field, default.get(field)) in values for field, values in self.where)

  @property
  def measured(self) -> str:
    return f"{self.date}, {self.device}"


@dataclasses.dataclass(frozen=True)
class Table:
  """A table of the page: one op on one suite of problems."""

  id: str
  title: str
  schema: str
  about: str
  baseline: str  # The baseline's name in the records.
  baseline_label: str
  implementations: tuple[tuple[str, str], ...]  # (name in the records, label); ours first.
  sources: tuple[Source, ...]
  notes: tuple[str, ...] = ()

  @property
  def labels(self) -> list[str]:
    return [label for _, label in self.implementations]

  @property
  def plot(self) -> str:
    return f"{PLOT_DIR}/perf-{self.id}.png"


@dataclasses.dataclass(frozen=True)
class Ratio:
  """A speed ratio to the baseline, with its range over the rounds where recorded."""

  value: float
  low: float | None = None
  high: float | None = None

  def __str__(self) -> str:
    text = f"{self.value:.3f}"
    if self.low is not None and self.high is not None and self.low != self.high:
      text += f" ({self.low:.3f}-{self.high:.3f})"
    return text


@dataclasses.dataclass(frozen=True)
class Row:
  """One problem of a table: its key cells, times and each implementation's ratio
  (a `Ratio`, or the error text of a failed run)."""

  cells: tuple[str, ...]
  baseline_us: float | None
  ours_us: float | None
  ratios: dict[str, Ratio | str]
  extra: tuple[str, ...]
  source: Source


@dataclasses.dataclass(frozen=True)
class Schema:
  """How to read the records of one benchmark tool."""

  writer: str
  key_columns: tuple[str, ...]
  extra_columns: tuple[str, ...]
  # The records of a file: the file is a list of them, or a document holding them.
  records: Callable[[object], list[dict]]
  rows: Callable[[list[dict], Table, Source], list[Row]]
  # Record fields a `where` filter reads when a record lacks them.
  defaults: dict = dataclasses.field(default_factory=dict)
  # The key columns that name a problem in a plot (those equal in every row are left out).
  plot_label_columns: tuple[int, ...] = (0, 1, 2)


def _grouped(records: list[dict], key: Callable[[dict], tuple]) -> dict[tuple, list[dict]]:
  """Records by key, keys in the order they first appear (the benchmark's order)."""
  groups: dict[tuple, list[dict]] = {}
  for record in records:
    groups.setdefault(key(record), []).append(record)
  return groups


def _ratio(record: dict, field: str, low: str | None = None, high: str | None = None):
  if "error" in record:
    return "error"
  if field not in record:
    return None
  return Ratio(record[field], record.get(low) if low else None, record.get(high) if high else None)


def _keyed_rows(records: list[dict], table: Table, source: Source, *, key: Callable,
                name: str, ratio: Callable, extra: Callable = lambda by_name: ()) -> list[Row]:
  """Rows of records that hold one implementation each (`name` field), grouped by `key`."""
  rows = []
  for cells, group in _grouped(records, key).items():
    by_name = {r[name]: r for r in group}
    ratios = {label: ratio(by_name[impl]) for impl, label in table.implementations
              if impl in by_name}
    ratios = {label: value for label, value in ratios.items() if value is not None}
    if not ratios:
      continue  # Only records this table does not show (e.g. another pass).
    ours = by_name.get(table.implementations[0][0], {})
    rows.append(Row(cells=cells, baseline_us=by_name.get(table.baseline, {}).get("median_us"),
                    ours_us=ours.get("median_us"), ratios=ratios, extra=extra(by_name),
                    source=source))
  return rows


def _bench_matmul_rows(records: list[dict], table: Table, source: Source) -> list[Row]:
  # The earliest records have no layout: they are all (M, K) x (K, N).
  return _keyed_rows(records, table, source, name="kernel",
                     key=lambda r: (r["shape"], r["dtype"], r.get("layout", "NN")),
                     ratio=lambda r: _ratio(r, "ratio_to_dot", "ratio_min", "ratio_max"))


def _bench_fp8_rows(records: list[dict], table: Table, source: Source) -> list[Row]:
  # One bf16 problem a row: each implementation's own dtypes are in its name.
  return _keyed_rows(records, table, source, name="kernel", key=lambda r: (r["shape"],),
                     ratio=lambda r: _ratio(r, "ratio_to_dot", "ratio_min", "ratio_max"))


def _bench_train_rows(records: list[dict], table: Table, source: Source) -> list[Row]:
  def errors(by_name):
    ours, xla = (by_name.get(name, {}).get("rel_error_max")
                 for name in (table.implementations[0][0], table.baseline))
    return ((f"{ours:.1e} / {xla:.1e}" if ours is not None and xla is not None else "-"),)

  return _keyed_rows([r for r in records if "skipped" not in r], table, source, name="impl",
                     key=lambda r: (r["size"], r["layer"], r["pass"].replace("_", " + ")),
                     ratio=lambda r: _ratio(r, "ratio_to_xla", "ratio_min", "ratio_max"),
                     extra=errors)


def _bench_ragged_dot_rows(records: list[dict], table: Table, source: Source) -> list[Row]:
  return _keyed_rows(records, table, source, name="impl",
                     key=lambda r: (r["layer"], f"{r['m']}x{r['k']}x{r['n']}, {r['groups']}",
                                    r["routing"]),
                     ratio=lambda r: _ratio(r, "ratio_to_dense"))


def _collective_rows(records: list[dict], table: Table, source: Source) -> list[Row]:
  """One row per record: a run of one device count (runs repeat, each a row)."""
  ((_, label),) = table.implementations
  return [Row(cells=(str(r["devices"]), f"{r['m_shard']}x{r['k']}x{r['n_shard']} {r['dtype']}",
                     r["implementation"]),
              baseline_us=r["baseline_us"], ours_us=r["kernel_us"],
              ratios={label: Ratio(r["speedup"])}, extra=(_us(r["lower_bound_us"]),),
              source=source)
          for r in records]


def _document_records(document) -> list[dict]:
  return document["records"]


def _listed_records(document) -> list[dict]:
  return document


SCHEMAS = {
    "bench_matmul": Schema(
        writer="tools/bench_matmul.py", key_columns=("M x K x N", "dtype", "layout"),
        extra_columns=(), records=_listed_records, rows=_bench_matmul_rows,
        defaults=dict(layout="NN")),
    "bench_fp8": Schema(
        writer="tools/bench_fp8.py", key_columns=("M x K x N",), extra_columns=(),
        records=_listed_records, rows=_bench_fp8_rows, plot_label_columns=(0,)),
    "bench_train": Schema(
        writer="tools/bench_train.py", key_columns=("size", "layer", "pass"),
        extra_columns=("largest error, ours / XLA",), records=_document_records,
        rows=_bench_train_rows),
    "bench_ragged_dot": Schema(
        writer="tools/bench_ragged_dot.py", key_columns=("layer", "M x K x N, experts", "routing"),
        extra_columns=(), records=_listed_records, rows=_bench_ragged_dot_rows,
        plot_label_columns=(0, 2)),
    "collective_table": Schema(
        writer="tools/bench_allgather_matmul.py", key_columns=(
            "devices", "per-device problem", "implementation"),
        extra_columns=("lower bound us",), records=_listed_records, rows=_collective_rows,
        defaults=dict(op="all_gather")),
}


def load_manifest(text: str) -> list[Table]:
  """The tables of a manifest (JSON); raises ValueError naming what is wrong."""
  tables, ids = [], set()
  for entry in json.loads(text)["tables"]:
    name = entry.get("id", "?")
    try:
      if entry["schema"] not in SCHEMAS:
        raise ValueError(f"schema {entry['schema']!r} is not one of {sorted(SCHEMAS)}")
      if not re.fullmatch(r"[a-z0-9-]+", entry["id"]) or entry["id"] in ids:
        raise ValueError("id must be unique, of lowercase letters, digits and hyphens")
      ids.add(entry["id"])
      sources = tuple(Source(json=s["json"], date=s["date"], device=s["device"],
                             command=s["command"],
                             where=tuple((f, tuple(v)) for f, v in s.get("where", {}).items()))
                      for s in entry["sources"])
      if not sources or not entry["implementations"]:
        raise ValueError("a table needs sources and implementations")
      tables.append(Table(id=entry["id"], title=entry["title"], schema=entry["schema"],
                          about=entry["about"], baseline=entry["baseline"],
                          baseline_label=entry["baseline_label"],
                          implementations=tuple(entry["implementations"].items()),
                          sources=sources, notes=tuple(entry.get("notes", ()))))
    except KeyError as e:
      raise ValueError(f"{MANIFEST}, table {name!r}: no field {e}") from None
    except ValueError as e:
      raise ValueError(f"{MANIFEST}, table {name!r}: {e}") from None
  return tables


def table_rows(table: Table, root: str) -> list[Row]:
  """The rows of `table`, from its sources' records under `root`."""
  schema = SCHEMAS[table.schema]
  rows = []
  for source in table.sources:
    path = os.path.join(root, "perf", source.json)
    if not os.path.exists(path):
      raise ValueError(f"{MANIFEST}, table {table.id!r}: no record file perf/{source.json}")
    with open(path) as f:
      records = schema.records(json.load(f))
    kept = [r for r in records if source.keeps(r, schema.defaults)]
    got = schema.rows(kept, table, source)
    if not got:
      raise ValueError(f"{MANIFEST}, table {table.id!r}: perf/{source.json} gives no row "
                       f"(its filter: {dict(source.where)})")
    rows += got
  return rows


def _us(value: float | None) -> str:
  if value is None:
    return "-"
  return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def median_ratios(table: Table, rows: list[Row]) -> dict[str, tuple[float, float, float, int]]:
  """Each implementation's (median, min, max, problems) over the rows it has a ratio in."""
  medians = {}
  for label in table.labels:
    values = [r.ratios[label].value for r in rows if isinstance(r.ratios.get(label), Ratio)]
    if values:
      medians[label] = (statistics.median(values), min(values), max(values), len(values))
  return medians


def slug(title: str) -> str:
  """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
  return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _measured(sources: tuple[Source, ...]) -> str:
  dates = sorted({s.date for s in sources})
  devices = sorted({s.device for s in sources})
  return (dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}") + ", " + " and ".join(
      devices)


def _median_text(median: tuple[float, float, float, int]) -> str:
  value, low, high, _ = median
  return f"{value:.3f}x" + (f" ({low:.3f}-{high:.3f})" if low != high else "")


SUMMARY_COLUMNS = ("results", "problems", "baseline", "ours, median (range)", "others, median",
                   "measured")


def summary_lines(tables: list[Table], rows: dict[str, list[Row]]) -> list[str]:
  """The summary table, one line per table; README.md repeats these lines."""
  lines = ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
  for table in tables:
    medians = median_ratios(table, rows[table.id])
    ours, *others = table.labels
    # An implementation that ran on fewer of the problems says on how many.
    other_text = "; ".join(
        f"{label} {medians[label][0]:.3f}x" + (f" ({medians[label][3]} problems)"
                                                if medians[label][3] != len(rows[table.id])
                                                else "")
        for label in others if label in medians) or "-"
    lines.append(f"| [{table.title}]({PAGE}#{slug(table.title)}) | {len(rows[table.id])} "
                 f"| {table.baseline_label} | **{_median_text(medians[ours])}** | {other_text} "
                 f"| {_measured(table.sources)} |")
  return lines


def table_section(table: Table, rows: list[Row]) -> list[str]:
  schema = SCHEMAS[table.schema]
  lines = [f"## {table.title}", "", table.about, ""]
  for note in table.notes:
    lines += [note, ""]
  lines.append(f"Records (written by `{schema.writer}`):")
  lines.append("")
  # A record file may feed a table twice (under two filters): it is listed once.
  listed = set()
  for source in table.sources:
    if source.json not in listed:
      listed.add(source.json)
      lines.append(f"- [`perf/{source.json}`](perf/{source.json}): {source.measured}; "
                   f"`{source.command}`")
  lines += ["", f"![{table.title}: ratio to the baseline]({table.plot})", ""]
  columns = (*schema.key_columns, f"{table.baseline_label} us", f"{table.labels[0]} us",
             *table.labels, *schema.extra_columns, "record")
  lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for row in rows:
    ratios = [str(row.ratios.get(label, "-")) for label in table.labels]
    link = f"[{row.source.measured}](perf/{row.source.json})"
    lines.append("| " + " | ".join((*row.cells, _us(row.baseline_us), _us(row.ours_us),
                                    *ratios, *row.extra, link)) + " |")
  medians = median_ratios(table, rows)
  lines += ["", "Median over the problems: " + "; ".join(
      f"{label} {_median_text(m)} ({m[3]} problems)" for label, m in medians.items()) + ".", ""]
  return lines


def render(tables: list[Table], rows: dict[str, list[Row]]) -> str:
  lines = [HEADER, "## Summary", "",
           "Each implementation's median ratio to the baseline over the problems of each "
           "table below.", "", *summary_lines(tables, rows), "",
           f"![The median ratio of each implementation to its baseline]({SUMMARY_PLOT})", ""]
  for table in tables:
    lines += table_section(table, rows[table.id])
  return "\n".join(lines).rstrip("\n") + "\n"


def _pyplot():
  import matplotlib  # noqa: PLC0415 - only the plots need it.

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  return plt


def _save(fig, path: str) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.tight_layout()
  # No software version in the file, so a rerun on the same records rewrites it unchanged.
  fig.savefig(path, dpi=72, bbox_inches="tight", metadata={"Software": None})


def _plain(text: str) -> str:
  """Markdown's code quotes dropped, for a plot's text."""
  return text.replace("`", "")


def _plot_labels(table: Table, rows: list[Row]) -> list[str]:
  """Each row's name in a plot: its label columns that differ between rows."""
  columns = [i for i in SCHEMAS[table.schema].plot_label_columns
             if len({r.cells[i] for r in rows}) > 1]
  return [" ".join(r.cells[i] for i in columns) for r in rows]


def plot_table(table: Table, rows: list[Row], path: str) -> None:
  """Each implementation's ratio per problem, bars by problem; a table of many problems
  gets each implementation's ratios sorted instead (a bar each would not be read)."""
  plt = _pyplot()
  labels = [label for label in table.labels
            if any(isinstance(r.ratios.get(label), Ratio) for r in rows)]
  many = len(rows) > 30
  height = 3.0 if many else 1.2 + 0.09 * len(rows) * (len(labels) + 1)
  fig, ax = plt.subplots(figsize=(6.4, height))
  if many:
    for label in labels:
      values = sorted(r.ratios[label].value for r in rows
                      if isinstance(r.ratios.get(label), Ratio))
      ax.plot(range(len(values)), values, marker=".", label=_plain(label))
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("problems, sorted by ratio", fontsize=7)
    ax.set_ylabel(f"ratio to {_plain(table.baseline_label)}", fontsize=7)
  else:
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
      ys = [r.ratios[label].value if isinstance(r.ratios.get(label), Ratio) else 0.0
            for r in rows]
      ax.barh([y + i * width for y in range(len(rows))], ys, width, label=_plain(label))
    ax.set_yticks([y + 0.4 - width / 2 for y in range(len(rows))])
    ax.set_yticklabels(_plot_labels(table, rows), fontsize=6)
    ax.invert_yaxis()
    ax.axvline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel(f"ratio to {_plain(table.baseline_label)} (above 1: faster)", fontsize=7)
  ax.tick_params(labelsize=6)
  ax.set_title(f"{_plain(table.title)}, {_measured(table.sources)}", fontsize=8)
  if len(labels) > 1:
    ax.legend(fontsize=6)
  _save(fig, path)
  plt.close(fig)


def plot_summary(tables: list[Table], rows: dict[str, list[Row]], path: str) -> None:
  """Our median ratio to the baseline per table, with the range over its problems."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(8.0, 1.0 + 0.25 * len(tables)))
  for y, table in enumerate(tables):
    median, low, high, _ = median_ratios(table, rows[table.id])[table.labels[0]]
    ax.barh(y, median, 0.6, color="C0" if median >= 1 else "C1")
    ax.errorbar(median, y, xerr=[[median - low], [high - median]], color="black",
                linewidth=0.8, capsize=2)
    ax.text(0.02, y, f"{median:.2f}x", va="center", fontsize=6, color="white")
  ax.set_yticks(range(len(tables)))
  ax.set_yticklabels([f"{_plain(t.title)} vs {_plain(t.baseline_label)}" for t in tables],
                     fontsize=6)
  ax.invert_yaxis()
  ax.axvline(1.0, color="gray", linewidth=0.8)
  ax.tick_params(labelsize=6)
  ax.set_xlabel("ours: the median ratio to the baseline (bar) and the range over the "
                "problems (line); above 1 is faster", fontsize=6)
  _save(fig, path)
  plt.close(fig)


def build(root: str) -> tuple[list[Table], dict[str, list[Row]], str]:
  """The manifest's tables, their rows and the page's text, from the records under `root`."""
  with open(os.path.join(root, MANIFEST)) as f:
    tables = load_manifest(f.read())
  rows = {table.id: table_rows(table, root) for table in tables}
  return tables, rows, render(tables, rows)


def write_plots(tables: list[Table], rows: dict[str, list[Row]], root: str) -> list[str]:
  paths = []
  for table in tables:
    paths.append(os.path.join(root, table.plot))
    plot_table(table, rows[table.id], paths[-1])
  paths.append(os.path.join(root, SUMMARY_PLOT))
  plot_summary(tables, rows, paths[-1])
  return paths


def default_root(environ=None) -> str:
  environ = os.environ if environ is None else environ
  return environ.get(WORKSPACE_ENV) or os.path.dirname(os.path.dirname(os.path.abspath(
      __file__)))


def main(argv):
  del argv
  root = cli.user_path(_ROOT.value) if _ROOT.value else default_root()
  tables, rows, page = build(root)
  page_path = os.path.join(root, PAGE)
  if _CHECK.value:
    with open(page_path) as f:
      if f.read() != page:
        sys.exit(f"{page_path} is not what the records give: run "
                 "`./bazelw run //tools:perf_page`")
    print(f"{page_path} is up to date")
    return
  with open(page_path, "w") as f:
    f.write(page)
  cli.say_written([page_path, *write_plots(tables, rows, root)])


if __name__ == "__main__":
  cli.run(main)
