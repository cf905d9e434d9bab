"""Prints the Python environment that Bazel runs our code in.

    ./bazelw run //bazel:python_env            interpreter, jax, devices
    ./bazelw run //bazel:python_env -- --pip   also `pip list`
"""

import platform
import subprocess
import sys

from absl import app, flags

_PIP = flags.DEFINE_boolean("pip", False, "Also print `pip list`.")


def main(argv: list[str]) -> None:
    del argv  # unused
    import jax

    print(f"python      {platform.python_version()}  {sys.executable}")
    print(f"sys.prefix  {sys.prefix}")
    print(f"jax         {jax.__version__}")
    print(f"backend     {jax.default_backend()}  {jax.devices()}")
    if _PIP.value:
        subprocess.run([sys.executable, "-m", "pip", "list"], check=True)


if __name__ == "__main__":
    app.run(main)
