"""Collective kernels across GPUs (the ring all-gather matmul and its portable XLA twin).

Not implemented yet; this package exists so that the layout, its Bazel package and
its import path are fixed for the code to come. It builds on `pipelines` through
`pipelines.emit_ws_matmul`'s `pipeline_callback` and `delay_release` hooks.
"""
