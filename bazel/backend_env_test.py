"""Checks that mgpu_kernel_test hands MGPU_TEST_BACKEND to its two tests.

`//bazel:backend_env_test` (CPU) must see "interpret"; `//bazel:backend_env_test_gpu` must
see "gpu" and a GPU, and on a machine where JAX sees no GPU it skips, saying why.
"""

import os

import jax
from absl.testing import absltest

from bazel import gpu_skip


def _expected_backend() -> str:
    target = os.environ.get("TEST_TARGET", "")
    return "gpu" if target.endswith("_gpu") else "interpret"


class BackendEnvTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        if _expected_backend() == "gpu":
            reason = gpu_skip.skip_reason(needed=1)
            if reason:
                print(f"SKIPPED: {reason}")
                self.skipTest(reason)

    def test_backend_env(self):
        self.assertEqual(os.environ.get("MGPU_TEST_BACKEND"), _expected_backend())

    def test_devices(self):
        if _expected_backend() == "gpu":
            self.assertEqual(jax.default_backend(), "gpu")
        else:
            self.assertEqual(jax.default_backend(), "cpu")


if __name__ == "__main__":
    absltest.main()
