"""The GPU runner's plan (`tools/gpu_tests.py`) and the `--shard` option (`conftest.py`)."""

import os
import tempfile

from absl.testing import absltest

import conftest
from tools import gpu_tests


class PlanTest(absltest.TestCase):
  def test_slow_files_are_split_and_start_first(self):
    times = {"a_test.py": 3 * gpu_tests.SHARD_TARGET_S - 1, "b_test.py": 5.0}
    jobs = gpu_tests.plan(["b_test.py", "a_test.py", "c_test.py"], times)
    self.assertEqual([(j.path, j.shard, j.shards) for j in jobs],
                     [("a_test.py", 0, 3), ("a_test.py", 1, 3), ("a_test.py", 2, 3),
                      ("c_test.py", 0, 1), ("b_test.py", 0, 1)])  # c: unrecorded, 30 s.
    self.assertEqual(jobs[0].name, "a_test.0of3")
    self.assertEqual(jobs[-1].name, "b_test")

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


if __name__ == "__main__":
  absltest.main()
