#!/usr/bin/env bash
# Runs the GPU work of this repo on a Hopper machine without Bazel (e.g. a
# bare GPU box with jax[cuda] installed): the GPU-tagged tests with pytest on
# the same test files Bazel runs, the autotuner and the benchmarks.
#
#   tools/gpu_check.sh tests [FILES]    # every test file, MGPU_TEST_BACKEND=gpu, in parallel
#   tools/gpu_check.sh tune SHAPES...   # autotune_matmul, updates the tuning cache
#   tools/gpu_check.sh bench [FLAGS]    # bench_matmul
#   tools/gpu_check.sh bench_fp8 [FLAGS]   # bench_fp8 (FP8 against bf16 and XLA's FP8 GEMM)
#   tools/gpu_check.sh main [FLAGS]     # examples/allgather_matmul, the main job
#   tools/gpu_check.sh bench_allgather [FLAGS]   # bench_allgather_matmul (2+ GPUs)
#
# Tests tagged multi_gpu are in the same files; their cases skip, saying why,
# when the host has fewer GPUs than they need.
#
# Logs and results go to $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
# What is already on PYTHONPATH (a folder of carried wheels: flax for
# pipelines/dot_general_test.py, a peer library for the benchmarks) stays on it.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MGPU_TEST_BACKEND=gpu
PY=${PYTHON:-python3}
step=$1
shift
case "$step" in
  tests)
    # Every test file in parallel pytest processes, each file (or shard of one) in its
    # own process (the examples define absl flags of the same names, which one process
    # cannot hold twice). Fails on any failed case and on a job that hangs.
    $PY tools/gpu_tests.py --out_dir="$OUT" "$@" 2>&1 | tee "$OUT/gpu_tests.log"
    ;;
  tune)
    $PY tools/autotune_matmul.py --out_dir="$OUT" "$@" 2>&1 | tee "$OUT/autotune.log"
    ;;
  bench)
    $PY tools/bench_matmul.py --out_dir="$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
    ;;
  bench_fp8)
    $PY tools/bench_fp8.py --out_dir="$OUT" "$@" 2>&1 | tee "$OUT/bench_fp8.log"
    ;;
  main)
    $PY -m examples.allgather_matmul "$@" 2>&1 | tee "$OUT/allgather_matmul.log"
    ;;
  bench_allgather)
    $PY -m tools.bench_allgather_matmul --out_dir="$OUT" "$@" 2>&1 | tee "$OUT/bench_allgather.log"
    ;;
  *)
    echo "usage: $0 tests|tune|bench|bench_fp8|main|bench_allgather [args]" >&2
    exit 2
    ;;
esac
