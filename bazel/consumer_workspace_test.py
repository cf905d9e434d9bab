"""Builds and tests a second Bazel workspace that depends on this one.

The consumer workspace, written under TEST_TMPDIR, has

    local_repository(name = "mgpu_kernels", path = <the real root of this repository>)

loads @mgpu_kernels//bazel:python.bzl for its Python toolchain, and has a plain `py_test` and
an `mgpu_kernel_test` (from @mgpu_kernels//bazel:defs.bzl) that import our code
workspace-relative. A nested `bazel test` must pass.

The nested Bazel reuses this test's interpreter (MGPU_PYTHON = sys.executable), so it
installs nothing, and copies the offline repository overrides of .bazelrc.offline when
bazelw wrote one. It needs the real workspace and a `bazel` (or `bazelisk`) on PATH: the
target is tagged "local".
"""

import os
import shutil
import subprocess
import sys
import textwrap

from absl import flags
from absl.testing import absltest

_PROBE = flags.DEFINE_string(
    "probe",
    "//core:quickstart",
    "Our py_library that the consumer workspace depends on, as //pkg:name: its code does "
    "`from pkg import name` and calls name.fill(shape, value). Set in bazel/BUILD.bazel.",
)

NESTED_TIMEOUT_S = 600
MARKER = "consumer workspace test ran"

# Environment variables handed to the nested Bazel; everything else (TEST_*, RUNFILES_*,
# PYTHONPATH, ... of this test) stays out.
PASS_ENV = (
    "PATH",
    "LANG",
    "LC_ALL",
    "USER",
    "LOGNAME",
    "PYENV_ROOT",
    "MGPU_JAX_VARIANT",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
)


def _runfile(path: str) -> str:
    return os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], path)


def repository_root() -> str:
    """The real root of this repository, through the runfiles symlink of a file in it."""
    marker = _runfile("bazel/python.bzl")
    real = os.path.realpath(marker)
    if real == os.path.abspath(marker):
        raise RuntimeError(f"{marker} is not a symlink into the workspace; run with tag 'local'")
    return os.path.dirname(os.path.dirname(real))


def find_bazel(root: str) -> tuple[str, bool]:
    """The Bazel to run, and whether it is Bazelisk (which reads .bazelversion).

    Like ./bazelw, prefers Bazelisk, then a binary named after the version (Debian ships
    bazel-4; its /usr/bin/bazel launcher insists on a bazel-<.bazelversion> binary).
    """
    path = shutil.which("bazelisk")
    if path:
        return path, True
    with open(os.path.join(root, ".bazelversion"), encoding="utf-8") as f:
        version = f.read().strip()
    for name in (f"bazel-{version}", f"bazel-{version.split('.')[0]}", "bazel"):
        path = shutil.which(name)
        if path:
            return path, False
    raise RuntimeError("no bazelisk, bazel-<version> or bazel on PATH")


def probe_dependency(label: str) -> tuple[str, str]:
    """"//core:quickstart" -> ("@mgpu_kernels//core:quickstart", "from core import quickstart")."""
    package, _, name = label.removeprefix("//").partition(":")
    if not package or not name:
        raise ValueError(f"--probe={label!r} is not of the form //package:name")
    module = package.replace("/", ".")
    return f"@mgpu_kernels//{package}:{name}", f"from {module} import {name} as probe"


def consumer_files(root: str, bazelisk: bool) -> dict[str, str]:
    target, import_line = probe_dependency(_PROBE.value)
    files = {
        "WORKSPACE": f"""\
            workspace(name = "consumer")

            local_repository(
                name = "mgpu_kernels",
                path = {root!r},
            )

            load("@mgpu_kernels//bazel:python.bzl", "mgpu_python_env")

            mgpu_python_env(name = "mgpu_python")

            register_toolchains("@mgpu_python//:toolchain")
            """,
        "BUILD.bazel": f"""\
            load("@mgpu_kernels//bazel:defs.bzl", "mgpu_kernel_test")

            py_test(
                name = "consumer_test",
                srcs = ["consumer_test.py"],
                main = "consumer_test.py",
                env = {{"MGPU_TEST_BACKEND": "interpret"}},
                python_version = "PY3",
                deps = [{target!r}],
            )

            mgpu_kernel_test(
                name = "consumer_kernel_test",
                src = "consumer_test.py",
                size = "small",
                deps = [{target!r}],
            )
            """,
        "consumer_test.py": f"""\
            import os
            import sys

            import numpy as np

            {import_line}

            print("sys.executable:", sys.executable)
            assert sys.version_info[:2] >= (3, 12), sys.version
            assert os.environ["MGPU_TEST_BACKEND"] == "interpret"
            out = np.asarray(probe.fill((8, 128), 2.0))
            assert out.shape == (8, 128) and np.all(out == 2.0), out
            print({MARKER!r})
            """,
        ".bazelrc": """\
            test --test_output=errors
            test --test_tag_filters=-gpu,-multi_gpu
            """,
    }
    files = {name: textwrap.dedent(text) for name, text in files.items()}
    offline = os.path.join(root, ".bazelrc.offline")
    if os.path.exists(offline):
        with open(offline, encoding="utf-8") as f:
            files[".bazelrc"] += "\n# From mgpu_kernels/.bazelrc.offline\n" + f.read()
    if bazelisk:
        with open(os.path.join(root, ".bazelversion"), encoding="utf-8") as f:
            files[".bazelversion"] = f.read()
    return files


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(function, failed_path, _):
        os.chmod(os.path.dirname(failed_path), 0o755)
        if os.path.isdir(failed_path) and not os.path.islink(failed_path):
            os.chmod(failed_path, 0o755)
        function(failed_path)

    if os.path.isdir(path):
        shutil.rmtree(path, onexc=make_writable_and_retry)


class ConsumerWorkspaceTest(absltest.TestCase):
    def test_consumer_workspace(self):
        root = repository_root()
        bazel_binary, bazelisk = find_bazel(root)
        tmp = os.environ["TEST_TMPDIR"]
        workspace = os.path.join(tmp, "consumer")
        os.makedirs(workspace)
        for name, text in consumer_files(root, bazelisk).items():
            with open(os.path.join(workspace, name), "w", encoding="utf-8") as f:
                f.write(text)

        env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
        env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})
        env["HOME"] = os.path.join(tmp, "home")
        os.makedirs(env["HOME"])
        env["MGPU_PYTHON"] = sys.executable
        bazel_root = os.path.join(tmp, "bazel_root")
        bazel = [
            bazel_binary,
            f"--output_user_root={bazel_root}",
            "--max_idle_secs=60",
        ]
        log = os.path.join(workspace, "bazel-testlogs", "consumer_test", "test.log")
        test_log = ""
        try:
            result = subprocess.run(
                [*bazel, "test", "//..."],
                cwd=workspace,
                env=env,
                capture_output=True,
                text=True,
                timeout=NESTED_TIMEOUT_S,
                check=False,
            )
            if os.path.exists(log):
                with open(log, encoding="utf-8", errors="replace") as f:
                    test_log = f.read()
        finally:
            subprocess.run(
                [*bazel, "shutdown"], cwd=workspace, env=env, capture_output=True, check=False
            )
            # Bazel keeps TEST_TMPDIR after the test; the nested output tree holds a link back
            # to this workspace, which recursive globs and file walkers would loop through.
            _remove_tree(bazel_root)
        output = result.stdout + result.stderr
        print(output[-6000:])
        self.assertEqual(result.returncode, 0, "nested `bazel test //...` failed, output above")
        self.assertIn("//:consumer_test", output)
        self.assertIn("//:consumer_kernel_test", output)
        self.assertNotIn("//:consumer_kernel_test_gpu", output)
        self.assertIn(MARKER, test_log)
        # The nested workspace ran on this interpreter: it reused our environment.
        self.assertIn(f"sys.executable: {sys.executable}", test_log)


if __name__ == "__main__":
    absltest.main()
