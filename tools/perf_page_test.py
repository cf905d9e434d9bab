"""PERFORMANCE.md is what the records in perf/ give, and the evidence the source cites exists.

  * The committed page is what `tools.perf_page` renders from perf/manifest.json
    and the records (rerun `./bazelw run //tools:perf_page` after changing either),
    and README.md repeats its summary table.
  * Every file in perf/ feeds a table or is named in docs/performance-log.md.
  * Every `docs/performance-log.md, "Title"` that a file cites names exactly one
    heading of the log (a heading that starts with Title), and every `perf/NAME`
    it names exists. The files are those this test sees: under Bazel its runfiles
    (the libraries it depends on, the docs, the records), outside Bazel the checkout.
  * Each benchmark schema reads its records as its writer writes them.

No GPU; matplotlib draws the plots (it is in the lock files).
"""

import json
import os
import re

from absl.testing import absltest

from tools import perf_page

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Files and folders the citation check does not read: outputs, environments, the records.
SKIPPED_DIRS = frozenset({".git", ".venv", ".nox", ".peer", "out", "perf", "__pycache__"})
CITING_SUFFIXES = (".py", ".md", ".bzl", ".sh", ".bazel")
CITATION = re.compile(r'docs/performance-log\.md`?,\s*("[^"]+"(?:\s*(?:,|and)\s*"[^"]+")*)')
RECORD = re.compile(r"\bperf/([\w.-]+\.(?:json|txt))")


def root() -> str:
  srcdir = os.environ.get("TEST_SRCDIR")
  if srcdir is None:  # Outside Bazel: the checkout.
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return os.path.join(srcdir, os.environ["TEST_WORKSPACE"])


def read(path: str) -> str:
  with open(os.path.join(root(), path), encoding="utf-8") as f:
    return f.read()


def citing_files() -> list[str]:
  """Paths (from the root) of the source and documents this test can see."""
  found = []
  for directory, subdirs, files in os.walk(root()):
    subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("bazel-")]
    found += [os.path.relpath(os.path.join(directory, f), root()) for f in files
              if f.endswith(CITING_SUFFIXES)]
  # This file's citations are made up for its own checks.
  return sorted(f for f in found if os.path.basename(f) != os.path.basename(__file__))


def flattened(text: str) -> str:
  """`text` with its line breaks, indents and comment marks made single spaces, so that
  a citation broken over comment lines reads as one."""
  return re.sub(r"\s*\n\s*(?:#+ ?)?", " ", text)


def log_headings() -> list[str]:
  return re.findall(r"^#{2,3} (.+)$", read(perf_page.LOG), re.M)


def records(kind: str) -> list[dict]:
  """Synthetic records of each schema, as its writer writes them."""
  if kind == "bench_matmul":
    return [
        dict(kernel="jnp.dot", shape="64x64x64", dtype="float16", layout="NN", median_us=10.0,
             ratio_to_dot=1.0, ratio_min=1.0, ratio_max=1.0),
        dict(kernel="ours: warp-specialized", shape="64x64x64", dtype="float16", layout="NN",
             median_us=8.0, ratio_to_dot=1.25, ratio_min=1.2, ratio_max=1.3),
        dict(kernel="ours: pipelined", shape="64x64x64", dtype="float16", layout="NN",
             error="ValueError: synthetic"),
        # A record of the earliest runs, which wrote no layout.
        dict(kernel="jnp.dot", shape="64x64x128", dtype="bfloat16", median_us=20.0,
             ratio_to_dot=1.0),
        dict(kernel="ours: warp-specialized", shape="64x64x128", dtype="bfloat16",
             median_us=25.0, ratio_to_dot=0.8),
    ]
  if kind == "bench_train":
    common = dict(size="tiny@128", layer="glu")
    return dict(device="synthetic", records=[
        dict(common, impl="xla", **{"pass": "forward"}, median_us=10.0, ratio_to_xla=1.0,
             rel_error_max=4e-3),
        dict(common, impl="ours", **{"pass": "forward"}, median_us=5.0, ratio_to_xla=2.0,
             ratio_min=1.9, ratio_max=2.1, rel_error_max=2e-3),
        dict(common, impl="tokamax", **{"pass": "forward"}, skipped="not installed"),
        dict(common, impl="ours", **{"pass": "backward"}, median_us=5.0, ratio_to_xla=0.5),
    ])
  if kind == "bench_ragged_dot":
    common = dict(layer="moe@64", routing="balanced", m=64, k=128, n=256, groups=4)
    return [dict(common, impl="dense", **{"pass": "forward"}, median_us=2.0, ratio_to_dense=1.0),
            dict(common, impl="ours", **{"pass": "forward"}, median_us=4.0, ratio_to_dense=0.5)]
  return [dict(op="all_gather", devices=2, m_shard=512, k=4096, n_shard=4096, dtype="float16",
               implementation="mosaic", kernel_us=60.0, baseline_us=84.0, lower_bound_us=54.0,
               speedup=1.4)]


def manifest(kind: str, **overrides) -> str:
  """A manifest of one table of schema `kind` over the synthetic records in `records.json`."""
  names = {"bench_matmul": ("jnp.dot", {"ours: warp-specialized": "ours",
                                        "ours: pipelined": "pipelined"}),
           "bench_train": ("xla", {"ours": "ours", "tokamax": "tokamax"}),
           "bench_ragged_dot": ("dense", {"ours": "ours"}),
           "collective_table": ("baseline", {"kernel": "ours"})}
  baseline, implementations = names[kind]
  table = dict(id="t", title=f"`{kind}`: a suite", schema=kind, about="About it.",
               baseline=baseline, baseline_label="the baseline",
               implementations=implementations,
               sources=[dict(json="records.json", date="2026-01-01", device="H200",
                             command="tools/bench.py")])
  table.update(overrides)
  return json.dumps({"tables": [table]})


class PageTest(absltest.TestCase):

  def test_the_page_is_what_the_records_give(self):
    _, _, page = perf_page.build(root())
    self.assertEqual(read(perf_page.PAGE), page,
                     "PERFORMANCE.md is not what perf/ gives: ./bazelw run //tools:perf_page")

  def test_the_readme_repeats_the_summary(self):
    tables, rows, _ = perf_page.build(root())
    summary = "\n".join(perf_page.summary_lines(tables, rows))
    self.assertIn(summary, read("README.md"),
                  "README.md's results table is not PERFORMANCE.md's summary: copy it over")

  def test_plots_are_drawn_and_committed(self):
    tables, rows, page = perf_page.build(root())
    out = self.create_tempdir().full_path
    for path in perf_page.write_plots(tables, rows, out):
      with open(path, "rb") as f:
        self.assertEqual(f.read(len(PNG_MAGIC)), PNG_MAGIC, path)
      committed = os.path.relpath(path, out)
      self.assertIn(f"]({committed})", page + read("README.md"))
      self.assertTrue(os.path.exists(os.path.join(root(), committed)),
                      f"{committed} is not committed: ./bazelw run //tools:perf_page")

  def test_every_record_feeds_a_table_or_is_in_the_log(self):
    known = read(perf_page.MANIFEST) + read(perf_page.LOG)
    files = [f for f in os.listdir(os.path.join(root(), "perf"))
             if f.endswith((".json", ".txt")) and f != os.path.basename(perf_page.MANIFEST)]
    self.assertNotEmpty(files)
    for name in files:
      self.assertIn(name, known, f"perf/{name} feeds no table and the log does not name it: "
                    "add it to perf/manifest.json or docs/performance-log.md, or delete it")


class CitationTest(absltest.TestCase):

  def test_cited_log_sections_exist(self):
    headings = log_headings()
    cited = 0
    for path in citing_files():
      for group in CITATION.findall(flattened(read(path))):
        for title in re.findall(r'"([^"]+)"', group):
          cited += 1
          with self.subTest(path=path, title=title):
            matches = [h for h in headings if h.startswith(title)]
            self.assertLen(matches, 1, f"{path} cites docs/performance-log.md, \"{title}\": "
                           f"{len(matches)} headings of the log start so")
    self.assertGreater(cited, 10)

  def test_cited_records_exist(self):
    for path in citing_files():
      for name in set(RECORD.findall(read(path))):
        with self.subTest(path=path, record=name):
          self.assertTrue(os.path.exists(os.path.join(root(), "perf", name)),
                          f"{path} names perf/{name}, which does not exist")


class SchemaTest(absltest.TestCase):

  def build(self, kind: str, **overrides):
    directory = self.create_tempdir()
    directory.create_file("perf/manifest.json", manifest(kind, **overrides))
    directory.create_file("perf/records.json", json.dumps(records(kind)))
    return perf_page.build(directory.full_path)

  def test_bench_matmul(self):
    tables, rows, page = self.build("bench_matmul")
    first, second = rows["t"]
    self.assertEqual(first.cells, ("64x64x64", "float16", "NN"))
    self.assertEqual((first.baseline_us, first.ours_us), (10.0, 8.0))
    self.assertEqual(str(first.ratios["ours"]), "1.250 (1.200-1.300)")
    self.assertEqual(first.ratios["pipelined"], "error")
    self.assertEqual(second.cells, ("64x64x128", "bfloat16", "NN"))
    self.assertEqual(perf_page.median_ratios(tables[0], rows["t"])["ours"], (1.025, 0.8, 1.25, 2))
    self.assertIn("| 64x64x64 | float16 | NN | 10.0 | 8.00 | 1.250 (1.200-1.300) | error |",
                  page)
    self.assertIn("[2026-01-01, H200](perf/records.json)", page)

  def test_bench_train_skips_and_filters(self):
    sources = [dict(json="records.json", date="2026-01-01", device="H100", command="x",
                    where={"pass": ["forward"]})]
    _, rows, page = self.build("bench_train", sources=sources)
    (row,) = rows["t"]
    self.assertEqual(row.cells, ("tiny@128", "glu", "forward"))
    self.assertEqual(set(row.ratios), {"ours"})  # tokamax was skipped.
    self.assertEqual(row.extra, ("2.0e-03 / 4.0e-03",))
    self.assertIn("H100", page)

  def test_bench_ragged_dot(self):
    _, rows, _ = self.build("bench_ragged_dot")
    (row,) = rows["t"]
    self.assertEqual(row.cells, ("moe@64", "64x128x256, 4", "balanced"))
    self.assertEqual(row.ratios["ours"].value, 0.5)

  def test_a_record_file_under_two_filters_is_listed_once(self):
    sources = [dict(json="records.json", date="2026-01-01", device="H200", command="x",
                    where={"dtype": ["float16"]}),
               dict(json="records.json", date="2026-01-01", device="H200", command="x",
                    where={"dtype": ["bfloat16"]})]
    _, rows, page = self.build("bench_matmul", sources=sources)
    self.assertLen(rows["t"], 2)
    self.assertEqual(page.count("- [`perf/records.json`]"), 1)

  def test_collective_table(self):
    _, rows, page = self.build("collective_table")
    (row,) = rows["t"]
    self.assertEqual(row.cells, ("2", "512x4096x4096 float16", "mosaic"))
    self.assertEqual((row.baseline_us, row.ours_us, row.extra), (84.0, 60.0, ("54.0",)))
    self.assertIn("**1.400x**", page)

  def test_the_summary_links_each_table(self):
    tables, rows, page = self.build("bench_matmul")
    (header, rule, line) = perf_page.summary_lines(tables, rows)
    self.assertIn(f"](PERFORMANCE.md#{perf_page.slug(tables[0].title)})", line)
    self.assertIn(f"## {tables[0].title}\n", page)
    self.assertEqual(perf_page.slug("Training layers: forward + backward"),
                     "training-layers-forward--backward")

  def test_a_bad_manifest_names_the_table_and_the_fault(self):
    with self.assertRaisesRegex(ValueError, r"table 't': schema 'nope' is not one of"):
      self.build("bench_matmul", schema="nope")
    with self.assertRaisesRegex(ValueError, r"table 't': no field 'about'"):
      perf_page.load_manifest(json.dumps({"tables": [
          {k: v for k, v in json.loads(manifest("bench_matmul"))["tables"][0].items()
           if k != "about"}]}))
    with self.assertRaisesRegex(ValueError, r"no record file perf/missing.json"):
      self.build("bench_matmul", sources=[dict(json="missing.json", date="d", device="H200",
                                              command="c")])
    with self.assertRaisesRegex(ValueError, r"gives no row"):
      self.build("bench_matmul", sources=[dict(json="records.json", date="d", device="H200",
                                              command="c", where={"dtype": ["float32"]})])

  def test_default_root_is_bazel_runs_workspace(self):
    self.assertEqual(perf_page.default_root({perf_page.WORKSPACE_ENV: "/src"}), "/src")


if __name__ == "__main__":
  absltest.main()
