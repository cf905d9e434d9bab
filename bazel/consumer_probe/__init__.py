"""A tiny Mosaic GPU kernel that another workspace imports in bazel/consumer_workspace_test.py.

It stands in for core/quickstart.py there (same `fill` signature): `from bazel import
consumer_probe` resolves the same way (workspace-relative) as `from core import quickstart`.
"""

import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


def _interpret_params():
    if os.environ.get("MGPU_TEST_BACKEND", "interpret") == "gpu":
        return None
    return plgpu.InterpretGPUParams(detect_races=True)


def fill(shape: tuple[int, ...], value: float, dtype=jnp.float32) -> jax.Array:
    """An array of `shape` and `dtype` filled with `value`, written by a Mosaic GPU kernel.

    Same signature as core.quickstart.fill. The array is staged whole in SMEM.
    """
    shape = tuple(shape)

    def body(out_gmem, out_smem):
        out_smem[...] = jnp.full(shape, value, dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem)
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(shape, dtype),
        scratch_types=[plgpu.SMEM(shape, dtype)],
        interpret=_interpret_params(),
    )
    return kernel()
