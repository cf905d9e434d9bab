"""Checks mgpu_kernel_test(multi_gpu = True): several devices on CPU and on GPUs.

`//bazel:multi_device_env_test` (CPU) must see MGPU_TEST_BACKEND=interpret and 8 CPU
devices (XLA_FLAGS set by the macro); `//bazel:multi_device_env_test_gpu` (tag multi_gpu,
--config=h100x8) must see "gpu" and more than one GPU, and skips, saying why, where JAX
sees fewer than two.
"""

import os

import jax
from absl.testing import absltest

from bazel import gpu_skip


def _expected_backend() -> str:
    return "gpu" if os.environ.get("TEST_TARGET", "").endswith("_gpu") else "interpret"


class MultiDeviceEnvTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        if _expected_backend() == "gpu":
            reason = gpu_skip.skip_reason(needed=2, config="h100x8")
            if reason:
                print(f"SKIPPED: {reason}")
                self.skipTest(reason)

    def test_backend_env(self):
        self.assertEqual(os.environ.get("MGPU_TEST_BACKEND"), _expected_backend())

    def test_devices(self):
        devices = jax.devices()
        if _expected_backend() == "gpu":
            self.assertEqual(devices[0].platform, "gpu")
            self.assertGreater(len(devices), 1)
        else:
            self.assertEqual(devices[0].platform, "cpu")
            self.assertLen(devices, 8)

    def test_psum_over_devices(self):
        n = jax.device_count()
        out = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")(jax.numpy.ones((n,)))
        self.assertEqual(float(out[0]), float(n))


if __name__ == "__main__":
    absltest.main()
