"""The tools' shared command-line pieces: where results go, help, jax's TPU line."""

import dataclasses
import enum
import logging
import os
import subprocess
import sys
import textwrap
from unittest import mock

from absl.testing import absltest

from tools import cli


class _Order(enum.Enum):
  ROWS = 0
  COLUMNS = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Settings:
  steps: int = 4
  width: int | None = None
  order: _Order = _Order.ROWS
  transposed: bool = False


class ParseConfigTest(absltest.TestCase):

  def test_ints_enums_and_bools(self):
    self.assertEqual(cli.parse_config(_Settings, "steps=8,width=64,order=COLUMNS,transposed=true"),
                     _Settings(steps=8, width=64, order=_Order.COLUMNS, transposed=True))
    self.assertEqual(cli.parse_config(_Settings, "transposed=False"), _Settings())
    self.assertEqual(cli.parse_config(_Settings, ""), _Settings())

  def test_fields_alone_for_a_replace(self):
    self.assertEqual(cli.parse_fields(_Settings, "steps=8,transposed=true"),
                     dict(steps=8, transposed=True))
    with self.assertRaisesRegex(ValueError, "has no field 'stages'"):
      cli.parse_fields(_Settings, "stages=4")

  def test_errors_name_the_field(self):
    with self.assertRaisesRegex(ValueError, "has no field 'stages'"):
      cli.parse_config(_Settings, "stages=4")
    with self.assertRaisesRegex(ValueError, "transposed=true or transposed=false, not '1'"):
      cli.parse_config(_Settings, "transposed=1")


class UserPathTest(absltest.TestCase):

  def test_relative_paths_follow_bazels_working_directory(self):
    user = self.create_tempdir().full_path
    env = {cli.WORKING_DIRECTORY_ENV: user}
    self.assertEqual(cli.user_path("out", env), os.path.join(user, "out"))
    self.assertEqual(cli.user_path("../x/y.json", env),
                     os.path.join(os.path.dirname(user), "x", "y.json"))
    self.assertEqual(cli.user_path("/abs/out", env), "/abs/out")

  def test_outside_bazel_run_relative_paths_follow_the_current_directory(self):
    self.assertEqual(cli.user_path("out", {}), os.path.join(os.getcwd(), "out"))
    self.assertEqual(cli.user_path("~/out", {}), os.path.expanduser("~/out"))

  def test_output_dir_is_created_where_the_user_ran_bazel(self):
    user = self.create_tempdir().full_path
    out = cli.output_dir("results/bench", {cli.WORKING_DIRECTORY_ENV: user})
    self.assertEqual(out, os.path.join(user, "results", "bench"))
    self.assertTrue(os.path.isdir(out))

  def test_say_written_prints_the_files_that_exist(self):
    present = self.create_tempfile("a.json").full_path
    missing = os.path.join(os.path.dirname(present), "b.png")
    with mock.patch("builtins.print") as printed:
      self.assertEqual(cli.say_written([present, missing]), [present])
    printed.assert_called_once_with(f"wrote {present}")


class HelpTest(absltest.TestCase):

  def test_asks_for_help(self):
    for argv in (["p", "--help"], ["p", "--x=1", "-?"], ["p", "--helpfull"], ["p", "--help=true"]):
      self.assertTrue(cli.asks_for_help(argv), argv)
    for argv in (["p"], ["p", "--x=1"], ["p", "--", "python", "--help"], ["p", "--help=false"]):
      self.assertFalse(cli.asks_for_help(argv), argv)

  def _program(self, *args):
    """A program that defines a flag and runs through `cli.run`, in its own process."""
    code = textwrap.dedent("""\
        import sys
        from absl import flags
        from tools import cli
        flags.DEFINE_integer("n", 1, "A number.")
        def main(argv):
          print("main ran")
          return int(argv[1]) if len(argv) > 1 else 0
        cli.run(main)
        """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=60)

  def test_help_exits_zero_after_printing_the_flags(self):
    result = self._program("--n=2", "--help")
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("--n: A number.", result.stdout)
    self.assertNotIn("main ran", result.stdout)

  def test_a_bad_flag_and_mains_status_are_kept(self):
    bad = self._program("--no_such_flag")
    self.assertEqual(bad.returncode, 1)
    self.assertIn("no_such_flag", bad.stderr)
    status = self._program("--n=3", "7")
    self.assertEqual(status.returncode, 7)
    self.assertIn("main ran", status.stdout)


class QuietTpuTest(absltest.TestCase):

  def test_only_the_absent_tpu_line_is_dropped(self):
    cli.quiet_absent_tpu()
    cli.quiet_absent_tpu()  # Idempotent: one filter.
    logger = logging.getLogger(cli.JAX_BACKEND_LOGGER)
    self.assertLen(logger.filters, 1)
    with self.assertLogs(logger, logging.INFO) as logs:
      logger.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so")
      logger.info("Unable to initialize backend 'cuda': no driver")
      logger.warning("An NVIDIA GPU may be present on this machine")
    self.assertEqual([r.getMessage() for r in logs.records],
                     ["Unable to initialize backend 'cuda': no driver",
                      "An NVIDIA GPU may be present on this machine"])


if __name__ == "__main__":
  absltest.main()
