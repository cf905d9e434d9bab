"""Why a GPU twin of an mgpu_kernel_test cannot run on this machine (bazel/ tests only)."""

import importlib.util
import os

import jax


def gpu_count() -> int:
    """GPUs that JAX sees; 0 with a CPU-only jaxlib or a CUDA jaxlib on a machine without one."""
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


def skip_reason(needed: int, config: str = "h100") -> str | None:
    """Why a GPU twin cannot run here, or None when it can."""
    count = gpu_count()
    if count >= needed:
        return None
    plugin = "a CUDA jaxlib" if _has_cuda_plugin() else "a CPU-only jaxlib (no jax CUDA plugin)"
    return (
        f"{os.environ.get('TEST_TARGET', 'this test')} needs {needed} GPU(s); JAX sees {count} "
        f"(backend {jax.default_backend()!r}, {plugin}). "
        f"Run it on a GPU host with --config={config}."
    )


def _has_cuda_plugin() -> bool:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
