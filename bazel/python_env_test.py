"""Checks the Python environment that Bazel runs tests in (bazel/python.bzl)."""

import os
import sys

from absl.testing import absltest

from bazel import check_lock

JAX_VERSION = "0.11.2"


def _runfile(path: str) -> str:
    return os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], path)


class PythonEnvTest(absltest.TestCase):
    def test_python_version(self):
        print(f"sys.version: {sys.version}\nsys.executable: {sys.executable}")
        self.assertGreaterEqual(sys.version_info[:2], (3, 12))

    def test_jax_version(self):
        import jax
        import jaxlib

        print(f"jax.__version__: {jax.__version__}")
        self.assertEqual(jax.__version__, JAX_VERSION)
        self.assertEqual(jaxlib.__version__, JAX_VERSION)

    def test_environment_matches_a_lock_file(self):
        problems = {}
        for variant in ("cpu", "cuda12"):
            lock = _runfile(f"requirements/{variant}.lock.txt")
            problems[variant] = check_lock.mismatches(check_lock.read_pins(lock))
            if not problems[variant]:
                print(f"environment matches requirements/{variant}.lock.txt")
                return
        self.fail(f"environment matches no lock file: {problems}")

    def test_jax_computes(self):
        import jax.numpy as jnp

        self.assertEqual(int(jnp.arange(5).sum()), 10)

    def test_workspace_relative_import(self):
        # `bazel` is a top-level folder of the repository, imported like `core` or `pipelines`.
        self.assertTrue(check_lock.__file__.endswith(os.path.join("bazel", "check_lock.py")))


if __name__ == "__main__":
    absltest.main()
