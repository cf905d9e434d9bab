"""The tuning cache: reading files that are broken, stores that fail, and stores from
several processes at once."""

import dataclasses
import json
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest

from pipelines import kernel_call, tuning_cache
from pipelines.config import MatmulDimension, Schedule, TuningConfig
from pipelines.operands import MatmulProblem, OperandLayout

PROBLEM = MatmulProblem(m=128, k=128, n=128, dtype=jnp.dtype(jnp.float16))
CONFIG = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                      epi_tile_m=64, epi_tile_n=32)
LOGGER = "pipelines.tuning_cache"

# Run as `python -c WORKER <role> <cache> <directory for flag files> <worker index> <stores>`.
WORKER = """
import json, logging, pathlib, sys, time
import jax.numpy as jnp
from pipelines import tuning_cache
from pipelines.config import TuningConfig
from pipelines.operands import MatmulProblem, OperandLayout

role, path, flags, worker, count = sys.argv[1:]
path, flags, worker, count = pathlib.Path(path), pathlib.Path(flags), int(worker), int(count)
config = TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
                      epi_tile_m=64, epi_tile_n=32)
if role == "reader":
  warnings = []
  handler = logging.Handler()
  handler.emit = warnings.append
  logging.getLogger("pipelines.tuning_cache").addHandler(handler)
  (flags / "reader_ready").touch()
  reads = errors = 0
  while not (flags / "stop").exists():
    try:
      text = path.read_text()
    except FileNotFoundError:
      continue
    reads += 1
    try:
      json.loads(text)
    except json.JSONDecodeError:
      errors += 1
    tuning_cache._load(path)
  print(json.dumps({"reads": reads, "errors": errors, "warnings": len(warnings)}))
else:
  while not (flags / "reader_ready").exists():
    time.sleep(0.01)
  for i in range(count):
    problem = MatmulProblem(m=8 * (1 + i), k=64, n=64 * (1 + worker),
                            dtype=jnp.dtype(jnp.float16))
    tuning_cache.store(problem, jnp.float16, config, median_us=float(i), path=path)
"""


class TuningCacheTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = pathlib.Path(tempfile.mkdtemp())
    self.cache = self.dir / "cache.json"
    self.enter_context(mock.patch.dict(os.environ, {tuning_cache.CACHE_ENV: str(self.cache)}))
    self.key = tuning_cache.cache_key(PROBLEM, jnp.float16)
    self.entry = {"config": tuning_cache.config_to_json(CONFIG), "median_us": 1.0}

  def write(self, text: str, path: pathlib.Path | None = None) -> None:
    # Replace rather than rewrite, as another process's store would.
    path = path or self.cache
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)

  def assert_falls_back_with_one_warning(self, *expected: str) -> None:
    """Lookups return None; the first warns naming the file and `expected`, the next is quiet."""
    with self.assertLogs(LOGGER, logging.WARNING) as logs:
      self.assertIsNone(tuning_cache.lookup(PROBLEM, jnp.float16))
    self.assertLen(logs.output, 1)
    self.assertIn(str(self.cache), logs.output[0])
    for text in expected:
      self.assertIn(text, logs.output[0])
    with self.assertNoLogs(LOGGER, logging.WARNING):
      self.assertIsNone(tuning_cache.lookup(PROBLEM, jnp.float16))

  def test_malformed_json_warns_once_and_falls_back(self):
    self.write('{"a": ')
    self.assert_falls_back_with_one_warning("is not valid JSON", "heuristic")

  def test_empty_file_warns_once_and_falls_back(self):
    self.write("")
    self.assert_falls_back_with_one_warning("is empty")

  def test_a_list_warns_once_and_falls_back(self):
    self.write(json.dumps([self.entry]))
    self.assert_falls_back_with_one_warning("holds a JSON list", "expected a JSON object")

  def test_entry_without_config_is_skipped_naming_the_key(self):
    self.write(json.dumps({self.key: {"median_us": 1.0}}))
    self.assert_falls_back_with_one_warning(repr(self.key), 'with a "config"')

  def test_entry_with_an_unknown_field_is_skipped_naming_the_key(self):
    self.write(json.dumps({self.key: {"config": dict(self.entry["config"], tile_q=3)}}))
    self.assert_falls_back_with_one_warning(repr(self.key), "tile_q")

  def test_entry_that_fails_validation_is_skipped_naming_the_key(self):
    self.write(json.dumps({self.key: {"config": dict(self.entry["config"], tile_k=24)}}))
    self.assert_falls_back_with_one_warning(repr(self.key), "tile_k")

  def test_entry_the_kernel_cannot_run_on_its_problem_is_skipped_naming_the_key(self):
    # A valid config, but under a (K, M) LHS its 32-element K step cannot be
    # swizzled: matmul would have raised on a config the user never gave.
    problem = dataclasses.replace(PROBLEM, layout=OperandLayout(transpose_lhs=True))
    key = tuning_cache.cache_key(problem, jnp.float16)
    self.write(json.dumps({key: {"config": tuning_cache.config_to_json(
        dataclasses.replace(CONFIG, tile_k=32))}}))
    with self.assertLogs(LOGGER, logging.WARNING) as logs:
      self.assertIsNone(tuning_cache.lookup(problem, jnp.float16))
    self.assertIn(repr(key), logs.output[0])
    self.assertIn("tile_k=32 must be a multiple of 64", logs.output[0])

  def test_entry_with_an_unknown_enum_name_is_skipped_naming_the_key(self):
    self.write(json.dumps({self.key: {"config": dict(self.entry["config"], schedule="ZIGZAG")}}))
    self.assert_falls_back_with_one_warning(repr(self.key), "ZIGZAG")

  def test_a_bad_entry_does_not_hide_good_ones(self):
    other = tuning_cache.cache_key(MatmulProblem(m=64, k=64, n=64, dtype=PROBLEM.dtype),
                                   jnp.float16)
    self.write(json.dumps({self.key: self.entry, other: {"config": {}}}))
    self.assertEqual(tuning_cache.lookup(PROBLEM, jnp.float16), CONFIG)

  def test_lookup_sees_a_file_another_process_replaced(self):
    self.assertIsNone(tuning_cache.lookup(PROBLEM, jnp.float16))  # No file yet.
    self.write("{}")
    self.assertIsNone(tuning_cache.lookup(PROBLEM, jnp.float16))
    self.write(json.dumps({self.key: self.entry}))
    self.assertEqual(tuning_cache.lookup(PROBLEM, jnp.float16), CONFIG)

  def test_store_keeps_entries_it_does_not_understand(self):
    foreign = {"my own notes": {"anything": [1, 2.5, None]},
               "NVIDIA H200|jax=0.1.0|1x16x8|float16->float16": {"config": {"tile_q": 3}}}
    self.write(json.dumps(foreign))
    self.assertEqual(tuning_cache.store(PROBLEM, jnp.float16, CONFIG, median_us=1.0), self.cache)
    self.assertEqual(json.loads(self.cache.read_text()), {**foreign, self.key: self.entry})
    self.assertEqual(tuning_cache.lookup(PROBLEM, jnp.float16), CONFIG)

  def test_store_through_a_symlink_updates_its_target(self):
    target = self.dir / "real" / "cache.json"
    target.parent.mkdir()
    target.write_text("{}")
    self.cache.symlink_to(target)
    self.assertEqual(tuning_cache.store(PROBLEM, jnp.float16, CONFIG, median_us=1.0), self.cache)
    self.assertTrue(self.cache.is_symlink())
    self.assertEqual(json.loads(target.read_text()), {self.key: self.entry})

  def test_store_leaves_a_file_it_cannot_parse_alone(self):
    fallback_dir = self.enter_context(tempfile.TemporaryDirectory())
    self.write("{ my hand edits, half done")
    with (mock.patch.object(tempfile, "tempdir", fallback_dir),
          self.assertLogs(LOGGER, logging.WARNING) as logs):
      stored_at = tuning_cache.store(PROBLEM, jnp.float16, CONFIG, median_us=1.0)
    self.assertEqual(self.cache.read_text(), "{ my hand edits, half done")
    self.assertEqual(stored_at, pathlib.Path(fallback_dir, "mgpu_cache.json"))
    self.assertIn(str(stored_at), logs.output[-1])
    self.assertEqual(json.loads(stored_at.read_text()), {self.key: self.entry})

  def test_store_under_a_missing_or_unwritable_directory_goes_to_the_fallback(self):
    blocker = self.dir / "a_file"
    blocker.write_text("")
    real_replace = os.replace

    def refuse_first_replace(src, dst, refused=[]):  # noqa: B006 - state across calls.
      if not refused:
        refused.append(dst)
        raise PermissionError(13, "Permission denied", str(dst))
      return real_replace(src, dst)

    # Tests run as root, whom chmod does not stop: a "directory" that is a regular
    # file, and a replace that is refused, stand in for a read-only directory.
    for name, path, replace in (("parent is a file", blocker / "cache.json", real_replace),
                                ("missing parent", self.dir / "missing" / "cache.json",
                                 real_replace),
                                ("replace refused", self.cache, refuse_first_replace)):
      with self.subTest(name):
        fallback_dir = self.enter_context(tempfile.TemporaryDirectory())
        with (mock.patch.object(tempfile, "tempdir", fallback_dir),
              mock.patch.object(os, "replace", replace),
              self.assertLogs(LOGGER, logging.WARNING) as logs):
          stored_at = tuning_cache.store(PROBLEM, jnp.float16, CONFIG, median_us=1.0,
                                         path=path)
        fallback = pathlib.Path(fallback_dir, "mgpu_cache.json")
        self.assertEqual(stored_at, fallback)
        self.assertIn(str(path), logs.output[-1])
        self.assertIn(f"stored it in {fallback}", logs.output[-1])
        self.assertEqual(json.loads(fallback.read_text()), {self.key: self.entry})
    # The refused replace left no temporary file behind, and no cache file.
    self.assertEqual(sorted(p.name for p in self.dir.iterdir()), ["a_file", "cache.json.lock"])

  def test_store_raises_naming_both_files_when_the_fallback_fails_too(self):
    blocker = self.dir / "a_file"
    blocker.write_text("")
    with (mock.patch.object(tempfile, "tempdir", str(blocker)),
          self.assertRaisesRegex(OSError, "could not store .* in .*a_file/cache.json .* nor "
                                 r"in .*a_file/mgpu_cache.json .*\"median_us\": 1.0")):
      tuning_cache.store(PROBLEM, jnp.float16, CONFIG, median_us=1.0, path=blocker / "cache.json")

  def test_concurrent_stores_keep_every_entry_and_readers_see_whole_files(self):
    writers, stores = 3, 60
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))

    def start(role, worker=0):
      return subprocess.Popen(
          [sys.executable, "-c", WORKER, role, str(self.cache), str(self.dir), str(worker),
           str(stores)], env=env, stdout=subprocess.PIPE, text=True)

    reader = start("reader")
    procs = [start("writer", worker) for worker in range(writers)]
    for p in procs:
      self.assertEqual(p.wait(timeout=120), 0)
    (self.dir / "stop").touch()
    out, _ = reader.communicate(timeout=60)
    self.assertEqual(reader.returncode, 0)
    counts = json.loads(out)
    self.assertGreater(counts["reads"], 0)
    self.assertEqual(counts["errors"], 0, counts)
    self.assertEqual(counts["warnings"], 0, counts)
    self.assertLen(json.loads(self.cache.read_text()), writers * stores)


class ShippedCacheTest(absltest.TestCase):

  def test_json_round_trip(self):
    for config in (TuningConfig(tile_m=64, tile_n=256, wg_dimension=MatmulDimension.M),
                   TuningConfig(tile_n=192, schedule=Schedule.PINGPONG)):
      self.assertEqual(tuning_cache.config_from_json(tuning_cache.config_to_json(config)),
                       config)
    # Entries written before schedules existed are cooperative.
    legacy = tuning_cache.config_to_json(TuningConfig())
    del legacy["schedule"]
    self.assertEqual(tuning_cache.config_from_json(legacy).schedule, Schedule.COOPERATIVE)

  def test_shipped_entries_are_usable_configs_for_their_problems(self):
    path = tuning_cache.DEFAULT_CACHE
    entries = tuning_cache._parse(path, path.read_text())
    self.assertNotEmpty(entries)
    for key, entry in entries.items():
      with self.subTest(key):
        kind, version, shape, dtypes = key.split("|")
        # An entry for another jax is never looked up again.
        self.assertEqual(version, f"jax={jax.__version__}")
        m, k, n = map(int, shape.split("x"))
        dtype, out_dtype = dtypes.split("->")
        problem = MatmulProblem(m=m, k=k, n=n, dtype=jnp.dtype(dtype))
        self.assertEqual(tuning_cache.cache_key(problem, out_dtype, device_kind=kind), key)
        kernel_call.check_ws_config(tuning_cache._entry_config(entry), problem, out_dtype)


if __name__ == "__main__":
  absltest.main()
