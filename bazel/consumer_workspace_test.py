"""Builds and tests the other workspace of docs/bazel-workspace.md, made from that page's text.

docs/bazel-workspace.md shows that workspace's files (fenced blocks whose first line is
`# FILENAME`) and the command to run in it (the `sh` block). This test parses the page at
run time, writes each file as it is, with only `/path/to/mgpu_kernels` replaced by the
real root of this repository, adds a `.bazelversion` (which Debian's `bazel` launcher
would reject) and runs the command: it must pass and run the page's test.

The nested Bazel reuses this test's interpreter (MGPU_PYTHON = sys.executable), so it
installs nothing, and gets its own output root under TEST_TMPDIR (startup options added to
the page's command). It needs the real workspace and a Bazel that bazelw finds or
installs: the target is tagged "local".
"""

import os
import re
import shutil
import subprocess
import sys

from absl.testing import absltest

PAGE = "docs/bazel-workspace.md"
PLACEHOLDER = "/path/to/mgpu_kernels"
# Below the 60 s of the target's size, "small" (the nested run takes about 12 s).
NESTED_TIMEOUT_S = 50
# What the page's test prints (a line of its matmul_test.py).
PAGE_MARKER = "mgpu_kernels matmul: OK"

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
    "MGPU_BAZEL_OFFLINE",
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


def read_page(root: str) -> str:
    """The text of docs/bazel-workspace.md in the repository at `root`."""
    with open(os.path.join(root, PAGE), encoding="utf-8") as f:
        return f.read()


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of markdown text, as (language, body)."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)


def consumer_workspace(page: str, root: str) -> tuple[dict[str, str], list[str]]:
    """The files ({name: text}) and the command lines of the page.

    A block whose first line is `# NAME` (one word) is the file NAME; an `sh` block holds
    commands, one a line. PLACEHOLDER is replaced by `root` everywhere.
    """
    files, commands = {}, []
    for language, body in fenced_blocks(page):
        body = body.replace(PLACEHOLDER, root)
        first = body.split("\n", 1)[0]
        name = re.fullmatch(r"# ([\w.-]+)", first)
        if language == "sh":
            commands += [line for line in body.split("\n") if line.strip()]
        elif name:
            if name.group(1) in files:
                raise ValueError(f"{PAGE}: two blocks for {name.group(1)}")
            files[name.group(1)] = body
        else:
            raise ValueError(f"{PAGE}: a block names no file (`# NAME` first line): {first!r}")
    for required in ("WORKSPACE", "BUILD.bazel"):
        if required not in files:
            raise ValueError(f"{PAGE} has no `# {required}` block")
    if len(commands) != 1:
        raise ValueError(f"{PAGE} should have one command, has {commands}")
    return files, commands


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(function, failed_path, _):
        os.chmod(os.path.dirname(failed_path), 0o755)
        if os.path.isdir(failed_path) and not os.path.islink(failed_path):
            os.chmod(failed_path, 0o755)
        function(failed_path)

    if os.path.isdir(path):
        shutil.rmtree(path, onexc=make_writable_and_retry)


class PageParsingTest(absltest.TestCase):
    def test_parses_files_and_command(self):
        page = "\n".join([
            "text",
            "```python",
            "# WORKSPACE",
            'local_repository(name = "mgpu_kernels", path = "/path/to/mgpu_kernels")',
            "```",
            "```python",
            "# BUILD.bazel",
            "py_test()",
            "```",
            "```sh",
            "/path/to/mgpu_kernels/bazelw test //...",
            "```",
        ])
        files, commands = consumer_workspace(page, "/root/x")
        self.assertEqual(sorted(files), ["BUILD.bazel", "WORKSPACE"])
        self.assertIn('path = "/root/x"', files["WORKSPACE"])
        self.assertEqual(commands, ["/root/x/bazelw test //..."])

    def test_page_has_the_workspace(self):
        files, commands = consumer_workspace(read_page(repository_root()), "/root/x")
        self.assertIn("mgpu_kernels_repositories()", files["WORKSPACE"])
        self.assertTrue(commands[0].startswith("/root/x/bazelw "), commands)


class ConsumerWorkspaceTest(absltest.TestCase):
    def test_page_workspace(self):
        root = repository_root()
        files, (command,) = consumer_workspace(read_page(root), root)
        with open(os.path.join(root, ".bazelversion"), encoding="utf-8") as f:
            files.setdefault(".bazelversion", f.read())

        tmp = os.environ["TEST_TMPDIR"]
        workspace = os.path.join(tmp, "consumer")
        os.makedirs(workspace)
        for name, text in files.items():
            with open(os.path.join(workspace, name), "w", encoding="utf-8") as f:
                f.write(text)

        env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
        env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})
        env["HOME"] = os.path.join(tmp, "home")
        os.makedirs(env["HOME"])
        env["MGPU_PYTHON"] = sys.executable
        bazel_root = os.path.join(tmp, "bazel_root")
        bazelw, *args = command.split()
        startup = [f"--output_user_root={bazel_root}", "--max_idle_secs=60"]
        print(f"in {workspace}: {command}")
        try:
            result = subprocess.run(
                [bazelw, *startup, *args, "--test_output=all"],
                cwd=workspace,
                env=env,
                capture_output=True,
                text=True,
                timeout=NESTED_TIMEOUT_S,
                check=False,
            )
        finally:
            subprocess.run(
                [bazelw, *startup, "shutdown"],
                cwd=workspace,
                env=env,
                capture_output=True,
                check=False,
            )
            # Bazel keeps TEST_TMPDIR after the test; the nested output tree holds a link back
            # to this workspace, which recursive globs and file walkers would loop through.
            _remove_tree(bazel_root)
        output = result.stdout + result.stderr
        print(output[-8000:])
        self.assertEqual(result.returncode, 0, f"`{command}` failed, output above")
        self.assertRegex(output, r"//:matmul_test\s+PASSED")
        self.assertIn(PAGE_MARKER, output)
        # The nested workspace ran on this interpreter: it reused our environment.
        self.assertNotIn("pip install", output)


if __name__ == "__main__":
    absltest.main()
