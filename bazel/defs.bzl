"""Build macros for mgpu_kernels.

    load("//bazel:defs.bzl", "mgpu_kernel_test", "mgpu_py_binary", "mgpu_py_library", "mgpu_py_test")

Imports are workspace-relative everywhere: `from core import x`,
`from pipelines.matmul import y`. Every target gets `imports` pointing at the root of the
repository that defines it, so those imports work in this workspace and in another
workspace that depends on this one through `local_repository(name = "mgpu_kernels", ...)`
(Bazel adds `<runfiles>/<repository>/<imports>` to sys.path). Top-level folders that hold
Python code must have an `__init__.py`.

Tests are single files, run directly (`if __name__ == "__main__": absltest.main()`).

`mgpu_kernel_test` makes two tests out of one file:
  - `name`: CPU, MGPU_TEST_BACKEND=interpret (Mosaic GPU interpret mode). Runs in a plain
    `bazel test //...`.
  - `name + "_gpu"`: real GPUs, MGPU_TEST_BACKEND=gpu, tagged `gpu` (or `multi_gpu` and
    `exclusive`). `bazel test //... --config=h100` (or `--config=h100x8`) runs them; the
    default configuration filters them out (see .bazelrc).
"""

# Environment variable through which a kernel test learns where it runs.
BACKEND_ENV = "MGPU_TEST_BACKEND"

# Tags of the tests that need GPUs. They also run unsandboxed ("local") so that they see the
# NVIDIA device files, the driver's caches and the user's CUDA environment as they are.
GPU_TAGS = ["gpu", "local"]
MULTI_GPU_TAGS = ["multi_gpu", "exclusive", "local"]

# Devices that a multi-GPU kernel test sees on CPU, unless its `env` sets XLA_FLAGS.
CPU_DEVICES_FOR_MULTI_GPU = 8

def _repo_root_import():
    """The `imports` entry that puts the root of this target's repository on sys.path."""
    package = native.package_name()
    if not package:
        return "."
    return "/".join([".."] * len(package.split("/")))

def _merge_env(*envs):
    out = {}
    for env in envs:
        out.update(env)
    return out

def mgpu_py_library(name, srcs, deps = [], data = [], visibility = ["//visibility:public"], **kwargs):
    """A py_library whose modules are imported workspace-relative (`from core import x`)."""
    native.py_library(
        name = name,
        srcs = srcs,
        deps = deps,
        data = data,
        imports = [_repo_root_import()],
        srcs_version = "PY3",
        visibility = visibility,
        **kwargs
    )

def mgpu_py_binary(name, src, deps = [], data = [], args = [], **kwargs):
    """A py_binary made of one file; `bazel run //pkg:name -- flags...`."""
    native.py_binary(
        name = name,
        srcs = [src],
        main = src,
        deps = deps,
        data = data,
        args = args,
        imports = [_repo_root_import()],
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )

def mgpu_py_test(name, src, deps = [], size = "small", env = {}, tags = [], data = [], shard_count = None, **kwargs):
    """A CPU test made of one file (absltest main)."""
    native.py_test(
        name = name,
        srcs = [src],
        main = src,
        deps = deps,
        data = data,
        env = env,
        size = size,
        tags = tags,
        shard_count = shard_count,
        imports = [_repo_root_import()],
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )

def mgpu_kernel_test(name, src, deps = [], size = "medium", env = {}, multi_gpu = False, data = [], shard_count = None, **kwargs):
    """One kernel test file, two tests: `name` (CPU, interpret mode) and `name_gpu` (GPU).

    Args:
      name: the CPU test; the GPU test is `name + "_gpu"`.
      src: the test file.
      deps: py_library dependencies.
      size: test size of both tests.
      env: extra environment of both tests (MGPU_TEST_BACKEND is set by this macro).
      multi_gpu: the test needs several GPUs: the GPU twin is tagged `multi_gpu` and
        `exclusive` instead of `gpu`, and the CPU test gets 8 CPU devices
        (XLA_FLAGS=--xla_force_host_platform_device_count=8) unless `env` sets XLA_FLAGS.
      data: data files of both tests.
      shard_count: shards of both tests.
      **kwargs: passed to both py_test rules (e.g. `timeout`).
    """
    extra_tags = kwargs.pop("tags", [])
    cpu_defaults = {}
    if multi_gpu:
        cpu_defaults["XLA_FLAGS"] = "--xla_force_host_platform_device_count=%d" % CPU_DEVICES_FOR_MULTI_GPU
    mgpu_py_test(
        name = name,
        src = src,
        deps = deps,
        size = size,
        env = _merge_env(cpu_defaults, env, {BACKEND_ENV: "interpret"}),
        tags = extra_tags,
        data = data,
        shard_count = shard_count,
        **kwargs
    )
    mgpu_py_test(
        name = name + "_gpu",
        src = src,
        deps = deps,
        size = size,
        env = _merge_env(env, {BACKEND_ENV: "gpu"}),
        tags = (MULTI_GPU_TAGS if multi_gpu else GPU_TAGS) + extra_tags,
        data = data,
        shard_count = shard_count,
        **kwargs
    )
