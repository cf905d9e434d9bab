"""`ruff check` over the repository's source tree (configuration: pyproject.toml).

The test runs unsandboxed (tag "local") and uncached (tag "external"): it follows the
runfiles symlink of pyproject.toml back to the real workspace and lints every Python file
there, including packages whose BUILD files list no lint target.
"""

import subprocess
import sys

from absl.testing import absltest

from bazel.workspace import workspace_root


class LintTest(absltest.TestCase):
    def test_ruff_check(self):
        root = workspace_root()
        cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "--no-fix", root]
        result = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
        output = (result.stdout + result.stderr).strip()
        print(f"$ {' '.join(cmd)}\n{output}")
        self.assertEqual(
            result.returncode,
            0,
            f"ruff reported problems (fix with `ruff check --fix` or by hand):\n{output}",
        )


if __name__ == "__main__":
    absltest.main()
