"""pytest setup shared by all packages (`nox -s gpu_tests`; Bazel does not use pytest).

The tests are absltest programs. absltest parses its flags in absltest.main(), which pytest
never calls; mark them parsed so that test helpers reading absl flags (create_tempdir,
FLAGS.test_srcdir, ...) work under pytest too.
"""

from absl import flags


def pytest_configure(config):
    del config  # unused
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
