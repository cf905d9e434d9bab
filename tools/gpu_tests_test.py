"""The GPU runner's plan (`tools/gpu_tests.py`) and the `--shard` option (`conftest.py`)."""

import json
import os
import tempfile

from absl.testing import absltest

import conftest
from tools import gpu_tests


class PlanTest(absltest.TestCase):
  def test_slow_files_are_split_and_start_first(self):
    times = {"a_test.py": 299.0, "b_test.py": 5.0}
    jobs = gpu_tests.split_files(["b_test.py", "a_test.py", "c_test.py"], times, 100.0)
    self.assertEqual([(j.path, j.shard, j.shards) for j in jobs],
                     [("a_test.py", 0, 3), ("a_test.py", 1, 3), ("a_test.py", 2, 3),
                      ("c_test.py", 0, 1), ("b_test.py", 0, 1)])  # c: unrecorded, 30 s.
    self.assertEqual(jobs[0].name, "a_test.0of3")
    self.assertEqual(jobs[-1].name, "b_test")

  def test_expected_wall_time(self):
    """Jobs in order, each on the first free slot, each with a start-up."""
    jobs = gpu_tests.split_files(["a_test.py", "b_test.py", "c_test.py"],
                                 {"a_test.py": 100.0, "b_test.py": 60.0, "c_test.py": 50.0},
                                 1000.0)
    self.assertEqual(gpu_tests.expected_wall_s(jobs, 2), 110 + 2 * gpu_tests.JOB_START_S)

  def test_plan_takes_the_shard_size_that_ends_first(self):
    """One 600 s file on 4 slots: 4 shards end first (150 s each, with one
    start-up), where 60 s shards pay 10 start-ups and 250 s shards leave a
    slot idle."""
    jobs = gpu_tests.plan(["a_test.py"], {"a_test.py": 600.0}, 4)
    self.assertEqual([j.shards for j in jobs], [4] * 4)
    self.assertEqual(gpu_tests.expected_wall_s(jobs, 4), 150 + gpu_tests.JOB_START_S)

  def test_recorded_times_name_test_files_of_the_packages(self):
    times = gpu_tests.recorded_times()
    self.assertIn("pipelines/cooperative_matmul_test.py", times)
    for path, seconds in times.items():
      self.assertRegex(path, rf"^({'|'.join(gpu_tests.PACKAGES)})/\w+_test\.py$")
      self.assertGreaterEqual(seconds, 0, path)

  def test_junit_counts_and_case_times(self):
    xml = ('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
           '<testcase classname="m.T" name="a" time="1.5"/>'
           '<testcase classname="m.T" name="b" time="0.5"><failure/></testcase>'
           '<testcase classname="m.T" name="c" time="0"><skipped/></testcase>'
           '</testsuite></testsuites>')
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "j.xml")
      with open(path, "w") as f:
        f.write(xml)
      counts, cases = gpu_tests.parse_junit(gpu_tests.Path(path))
    self.assertEqual(counts, {"tests": 3, "failures": 1, "errors": 0, "skipped": 1})
    self.assertEqual([(c["id"], c["time_s"], c["outcome"]) for c in cases],
                     [("m.T.a", 1.5, "passed"), ("m.T.b", 0.5, "failure"),
                      ("m.T.c", 0.0, "skipped")])


class ShardOptionTest(absltest.TestCase):
  def test_parse(self):
    self.assertEqual(conftest.parse_shard("1/4"), (1, 4))
    for bad in ("4/4", "-1/2", "1", "a/b", "0/0"):
      with self.subTest(bad), self.assertRaisesRegex(ValueError, "must be I/N"):
        conftest.parse_shard(bad)

  def test_case_id_is_the_junit_id(self):
    self.assertEqual(conftest.case_id("pipelines/fp8_test.py::Fp8MatmulTest::test_real_size"),
                     "pipelines.fp8_test.Fp8MatmulTest.test_real_size")
    self.assertEqual(conftest.case_id("tools/x_test.py::test_y"), "tools.x_test.test_y")

  def test_shards_dealt_by_time(self):
    """The longest first, each to the least loaded shard: 13 and 11 s where
    dealing in turn gives 14 and 10; the unrecorded case "f" counts as the
    median (4 s). Without times, in turn."""
    ids = ["a", "b", "c", "d", "e", "f"]
    times = {"a": 9.0, "b": 5.0, "c": 4.0, "d": 1.0, "e": 1.0}
    shards = conftest.deal_by_times(ids, times, 2)
    self.assertEqual(shards, [0, 1, 1, 1, 1, 0])
    self.assertEqual([sum(times.get(i, 4.0) for i, s in zip(ids, shards, strict=True) if s == shard)
                      for shard in (0, 1)], [13.0, 11.0])
    self.assertEqual(conftest.deal_by_times(ids, {}, 3), [0, 1, 2, 0, 1, 2])

  def test_recorded_case_times_name_cases_of_recorded_files(self):
    recorded = json.loads(gpu_tests.TIMES_FILE.read_text())
    self.assertTrue(gpu_tests.has_case_times())
    modules = [path.removesuffix(".py").replace("/", ".") for path in recorded["file_case_s"]]
    for case, seconds in recorded["case_s"].items():
      self.assertTrue(any(case.startswith(module + ".") for module in modules), case)
      self.assertGreaterEqual(seconds, 0, case)

if __name__ == "__main__":
  absltest.main()
