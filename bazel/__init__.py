"""Build support for mgpu_kernels: Bazel macros, the Python environment and their tests."""
