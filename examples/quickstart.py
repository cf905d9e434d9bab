"""Runs the quickstart kernels (fill, gridded iota) and checks them.

    bazel run //examples:quickstart

On a Hopper GPU the kernels compile for it; with no GPU they run in Mosaic GPU's
interpret mode on CPU (with race detection). The first line says which. The
kernels are in `examples/quickstart_kernels.py`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from absl import flags

from core import device_facts, is_interpreting
from examples import quickstart_kernels
from tools import cli

_LENGTH = flags.DEFINE_integer("length", 4096, "Length of the iota (a multiple of --block).",
                               lower_bound=1)
_BLOCK = flags.DEFINE_integer("block", 256, "Elements per grid block of the iota.", lower_bound=1)


def main(argv):
  del argv
  facts = device_facts()
  where = ("GPU interpret mode on CPU (no GPU found; kernels are simulated)"
           if is_interpreting() else f"GPU: {facts.name}, {facts.sm_count} SMs")
  print(f"running on {where}")
  filled = quickstart_kernels.fill((8, 128), 42.0)
  np.testing.assert_array_equal(np.asarray(filled), np.full((8, 128), 42.0, np.float32))
  print(f"fill((8, 128), 42.0): every element is 42.0 -> {np.asarray(filled)[0, :4]} ...")
  out = quickstart_kernels.iota(_LENGTH.value, block=_BLOCK.value, dtype=jnp.int32)
  np.testing.assert_array_equal(np.asarray(out), np.arange(_LENGTH.value))
  print(f"iota({_LENGTH.value}, block={_BLOCK.value}): {_LENGTH.value // _BLOCK.value} blocks, "
        f"matches arange -> {np.asarray(out)[:4]} ... {np.asarray(out)[-2:]}")
  print("quickstart: OK")


if __name__ == "__main__":
  cli.run(main)
