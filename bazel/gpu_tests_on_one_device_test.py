"""The GPU twins' test files, run as on a host of one device: every case passes or skips.

`./bazelw test //... --config=h100` on a workstation with one GPU runs the `_gpu` twin of
every `mgpu_kernel_test` (and skips the `multi_gpu` ones only by tag). A case that assumes
several devices outside the kernel tests' own device checks (a 2-device mesh built to
validate arguments, say) fails there, and no CPU test would notice: the CPU twins of the
collectives see 8 simulated devices. This test runs every such file under
MGPU_TEST_BACKEND=gpu with a single (CPU) device, each file in a pytest process of its own
(as the GPU runner `tools/gpu_tests.py` does: two tools' modules may define absl flags of
the same name, which one process cannot hold), and fails on any failure or error. Cases
that need a Hopper GPU skip here (no GPU); the rest (validation, heuristics, lowering) run
and must either pass or skip with their reason on one device.

The files come from the BUILD files themselves (every `mgpu_kernel_test`'s `src`), so a new
kernel test is covered without a list to keep. Those of `//bazel` check the macro's own
environment under Bazel (`TEST_TARGET`), which a pytest run outside Bazel does not have;
they are left out. Runs unsandboxed ("local", uncached "external"), as `:lint_test` does,
to reach the real source tree through the runfiles symlink of pyproject.toml.
"""

import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from absl.testing import absltest

from bazel.workspace import workspace_root

# `mgpu_kernel_test(... src = "x_test.py" ...)` in a BUILD file.
_KERNEL_TEST = re.compile(r"mgpu_kernel_test\((?:[^()]|\([^()]*\))*?\bsrc\s*=\s*\"([^\"]+)\"",
                          re.S)
# The package of the macro's own environment tests (see the module docstring).
_OWN_PACKAGE = "bazel"


def kernel_test_files(root: str) -> list[str]:
    """The `src` of every `mgpu_kernel_test` outside //bazel, relative to `root`."""
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith((".", "bazel-")))
        package = os.path.relpath(directory, root)
        if "BUILD.bazel" not in names or package == _OWN_PACKAGE:
            continue
        with open(os.path.join(directory, "BUILD.bazel")) as f:
            for src in _KERNEL_TEST.findall(f.read()):
                files.append(os.path.normpath(os.path.join(package, src)))
    return sorted(files)


def one_device_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEST_", "XML_OUTPUT"))}
    env.update({
        "MGPU_TEST_BACKEND": "gpu",
        # One device, as on a workstation with one GPU (jax.device_count() == 1).
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "JAX_PLATFORMS": "cpu",
    })
    return env


class GpuTestsOnOneDeviceTest(absltest.TestCase):
    def test_every_case_passes_or_skips(self):
        root = workspace_root()
        files = kernel_test_files(root)
        self.assertGreater(len(files), 5, f"found only {files} under {root}")
        counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
        outputs = []
        with tempfile.TemporaryDirectory() as tmp:
            for index, path in enumerate(files):
                junit = os.path.join(tmp, f"junit{index}.xml")
                cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                       f"--junitxml={junit}", path]
                result = subprocess.run(cmd, cwd=root, env=one_device_env(),
                                        capture_output=True, text=True, check=False)
                output = (result.stdout + result.stderr).strip()
                print(f"$ {' '.join(cmd)}\n{output}")
                if not os.path.exists(junit):  # pytest stopped before it ran anything.
                    counts["errors"] += 1
                    outputs.append(f"{path}: exit {result.returncode}\n{output[-3000:]}")
                    continue
                suite = ET.parse(junit).getroot()
                suites = [suite] if suite.tag == "testsuite" else list(suite.iter("testsuite"))
                for key in counts:
                    counts[key] += sum(int(s.get(key, 0)) for s in suites)
                if result.returncode != 0:
                    outputs.append(f"{path}: exit {result.returncode}\n{output[-3000:]}")
        output = "\n".join(outputs)
        self.assertEqual(counts["failures"] + counts["errors"], 0,
                         f"cases that fail with MGPU_TEST_BACKEND=gpu on one device: {counts}"
                         f"\n{output[-6000:]}")
        self.assertFalse(outputs, output[-6000:])
        # Not everything may skip: validation and heuristics run without a GPU.
        self.assertGreater(counts["tests"] - counts["skipped"], 0, counts)


if __name__ == "__main__":
    absltest.main()
