"""The real source tree of this workspace, for tests that run unsandboxed (tag "local")."""

import os


def workspace_root() -> str:
    """The workspace's directory, found through the runfiles symlink of pyproject.toml.

    The test must list `//:pyproject.toml` in its data and run with tag "local", so that
    the runfile is a symlink into the workspace rather than a copy in a sandbox.
    """
    marker = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], "pyproject.toml")
    real = os.path.realpath(marker)
    if real == os.path.abspath(marker):
        raise RuntimeError(f"{marker} is not a symlink into the workspace; run with tag 'local'")
    return os.path.dirname(real)
