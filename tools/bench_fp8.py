"""Benchmarks the block-scaled FP8 matmul against bf16 and XLA's FP8 GEMM.

    bazel run //tools:bench_fp8 -- --out_dir=/tmp/bench

For each problem (by default the bf16 prefill and training-forward GEMMs of
`tools/model_shapes.py` with at least `--min_m` rows, plus 8192^3), on random
normal data, it times with CUPTI after warm-up, the implementations taking
turns for `--rounds` rounds in the same process:
  jnp.dot                 bf16 `jnp.dot` (the baseline)
  ours: bf16              `pipelines.matmul` in bf16
  ours: fp8 block-scaled  `pipelines.fp8_matmul` on operands quantized in
                          (1, 128) and (128, 128) blocks beforehand (weights
                          are stored quantized; an activation's quantization
                          is the `fp8_linear` rows' business), on the
                          default (warp-specialized, persistent) kernel with
                          `fp8.default_config`'s tiles, (", 2 warpgroups")
                          with its 128-row tiles, (", one block per tile")
                          on its parallel grid
                          (`Fp8Config.persistent`), (", 1 warpgroup") on
                          the one-warpgroup one (`Fp8Config.compute_wgs`)
                          and (", two blocks a step") in pipeline steps of
                          two scale blocks (`Fp8Config.k_blocks_per_step`)
  ours: fp8 per-tensor    `fp8_matmul` with one scale per operand (the
                          persistent kernel of `matmul`, scaled in its
                          epilogue)
  xla: fp8 per-tensor     XLA's FP8 GEMM (cuBLAS): `lax.dot_general` of the
                          e4m3 operands into float32, times the product of
                          the two scales, in bf16
  xla: dequantize + bf16  the block-scaled operands dequantized to bf16 and
                          multiplied by `jnp.dot`: what JAX users do today
and, with `--train`, a layer's forward + backward from a bf16 cotangent:
`fp8_linear` (by default, with 128-row tiles, and in steps of two scale
blocks) against
`pipelines.matmul` and XLA's autodiff of `jnp.dot`.
With `--quantized_output`, a bf16 product whose output is quantized for the
next FP8 matmul, in (1, 128) blocks, against XLA's `jnp.dot` then XLA's
`quantize_fp8_reference` (the baseline of these rows):
  ours: bf16, then quantize_fp8            `matmul`, then the quantization kernel
  ours: bf16, quantized in the epilogue    `matmul(..., out_dtype=float8_e4m3fn)`
Each record has the time, TFLOP/s, the ratio to `jnp.dot` (the median of the
rounds' ratios, and their range) and the relative error against the float32
product of the unquantized data (FP8's own rounding included).

With `--quantize_both_layouts`, the quantization of an FP8 training step's
operands in both of their layouts (each of x, g and w enters two products: as
stored and transposed), at the cotangent's shape (M, N) in (1, 128) blocks and
the weight's (K, N) in (128, 128) blocks, against XLA's `quantize_fp8_reference`
of the tensor and of its transpose (the baseline of these rows):
  quantize both layouts: ours, one read   `quantize_fp8_both_layouts`
With `--quantize_one_layout`, an activation (M, K) in (1, 128) blocks and a
weight (K, N) transposed in (128, 128) blocks (as `fp8_matmul` takes its RHS),
against XLA's `quantize_fp8_reference` (of w.T for the weight; the baseline of
these rows):
  quantize one layout: ours, one read     `quantize_fp8`, with `transpose` for the weight

With `--precision`, it also measures `fp8_matmul`'s error against the float32
product of the dequantized operands (the same e4m3 values and scales: the
kernel's own error, not FP8's rounding) at each K of `--precision_k`, with a
float32 output: on both block-scaled kernels, with one scale per operand,
and XLA's per-tensor FP8 GEMM; norm-wise, and each element's error over the
sum of its products' magnitudes (the bound `docs/fp8.md` states).

Writes `fp8_bench.json` to `--out_dir`. Needs a Hopper GPU.
"""

from __future__ import annotations

import functools
import os
import statistics

import jax
import jax.numpy as jnp
from absl import flags

from core import has_gpu, timing
from core.numerics import relative_error_on_device
from pipelines import (
    Fp8Config,
    dequantize_fp8,
    fp8_linear,
    fp8_matmul,
    matmul,
    quantize_fp8,
    quantize_fp8_both_layouts,
    quantize_fp8_reference,
)
from pipelines.config import FP8_DTYPE
from pipelines.fp8_quantize import E4M3_MAX, ROW_BLOCK, SQUARE_BLOCK
from tools import cli, model_shapes, report

BASELINE = "jnp.dot"
# `Fp8Config.k_blocks_per_step` = 2, in slots of the SMEM of the default's.
TWO_BLOCK_STEPS = Fp8Config(k_blocks_per_step=2, max_concurrent_steps=2)
TRAIN_BASELINE = "train: jnp.dot (XLA autodiff)"
QUANTIZED_BASELINE = "quantized output: jnp.dot, then XLA's quantize_fp8_reference"
BOTH_LAYOUTS_BASELINE = "quantize both layouts: XLA, quantize_fp8_reference of x and x.T"
ONE_LAYOUT_BASELINE = "quantize one layout: XLA, quantize_fp8_reference"

_OUT_DIR = flags.DEFINE_string("out_dir", os.environ.get("OUT", "out"),
                               "Where results go; relative to where the command ran.")
_SHAPES = flags.DEFINE_list("shapes", None, "Problems as MxKxN (instead of the model shapes).")
_MIN_M = flags.DEFINE_integer("min_m", 1024, "Fewest rows of a model-suite problem to time.",
                              lower_bound=1)
_ITERATIONS = flags.DEFINE_integer("iterations", 20, "Timed runs per implementation and round.",
                                   lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Rounds in which the implementations take turns.",
                               lower_bound=1)
_TRAIN = flags.DEFINE_bool("train", False, "Also time a layer's forward + backward.")
_QUANTIZED_OUTPUT = flags.DEFINE_bool(
    "quantized_output", False, "Also time a bf16 product whose output is quantized to e4m3.")
_BOTH_LAYOUTS = flags.DEFINE_bool(
    "quantize_both_layouts", False,
    "Also time the quantization of a tensor and its transpose (the cotangent's and the "
    "weight's shapes).")
_ONE_LAYOUT = flags.DEFINE_bool(
    "quantize_one_layout", False,
    "Also time the quantization of an activation (M, K) and of a weight (K, N) as the "
    "transposed RHS fp8_matmul takes.")
_PRECISION = flags.DEFINE_bool("precision", False,
                               "Also measure the kernels' error at each K of --precision_k.")
_PRECISION_K = flags.DEFINE_list("precision_k", ["128", "1024", "4096", "16384"],
                                 "K of the --precision problems (M = N = 1024).")


def default_problems(min_m: int) -> list[tuple[int, int, int]]:
  """The (M, K, N) of the models suite's NN prefill and training-forward
  GEMMs with at least `min_m` rows (both halves), then 8192^3."""
  steps = {model_shapes.PREFILL, model_shapes.TRAIN_FORWARD}
  shapes = sorted({(p.m, p.k, p.n) for p in model_shapes.suite()
                   if p.layout == model_shapes.NN and p.m >= min_m and steps & set(p.steps)})
  return [*shapes, (8192, 8192, 8192)]


def forward_implementations(x, w) -> tuple[dict, dict]:
  """{name: fn(operands)} of the forward products of x (M, K) @ w (K, N), and
  `operands`: x and w in bf16, and quantized in blocks and per tensor."""
  xq, xs = quantize_fp8(x, ROW_BLOCK)
  wq, ws = quantize_fp8(w, SQUARE_BLOCK, transpose=True)
  x_scale = jnp.max(jnp.abs(x)).astype(jnp.float32) / E4M3_MAX
  w_scale = jnp.max(jnp.abs(w)).astype(jnp.float32) / E4M3_MAX
  operands = dict(x=x, w=w, xq=xq, xs=xs, wq=wq, ws=ws, x_scale=x_scale, w_scale=w_scale,
                  xt=(x / x_scale).astype(FP8_DTYPE), wt=(w.T / w_scale).astype(FP8_DTYPE))

  def times_transposed(lhs, rhs):
    """lhs @ rhs.T in bf16 as a user writes it, the output in bf16 (a float32
    one would cost cuBLAS twice the output bytes and XLA a conversion pass)."""
    return jax.lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())))

  def xla_per_tensor(o):
    # A dot of e4m3 operands is one cuBLAS FP8 GEMM; XLA folds the scaling
    # and the cast into its epilogue.
    product = jax.lax.dot_general(o["xt"], o["wt"], (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    return (product * (o["x_scale"] * o["w_scale"])).astype(jnp.bfloat16)

  def dequantized(o):
    return times_transposed(dequantize_fp8(o["xq"], o["xs"], ROW_BLOCK).astype(jnp.bfloat16),
                            dequantize_fp8(o["wq"], o["ws"], SQUARE_BLOCK).astype(jnp.bfloat16))

  impls = {
      BASELINE: lambda o: jnp.dot(o["x"], o["w"]),
      "ours: bf16": lambda o: matmul(o["x"], o["w"]),
      "ours: fp8 block-scaled": lambda o: fp8_matmul(o["xq"], o["wq"], o["xs"], o["ws"]),
      "ours: fp8 block-scaled, 2 warpgroups": lambda o: fp8_matmul(
          o["xq"], o["wq"], o["xs"], o["ws"], config=Fp8Config()),
      "ours: fp8 block-scaled, one block per tile": lambda o: fp8_matmul(
          o["xq"], o["wq"], o["xs"], o["ws"], config=Fp8Config(persistent=False)),
      "ours: fp8 block-scaled, 1 warpgroup": lambda o: fp8_matmul(
          o["xq"], o["wq"], o["xs"], o["ws"], config=Fp8Config(compute_wgs=1)),
      "ours: fp8 block-scaled, two blocks a step": lambda o: fp8_matmul(
          o["xq"], o["wq"], o["xs"], o["ws"], config=TWO_BLOCK_STEPS),
      "ours: fp8 per-tensor": lambda o: fp8_matmul(o["xt"], o["wt"], o["x_scale"],
                                                   o["w_scale"]),
      "xla: fp8 per-tensor": xla_per_tensor,
      "xla: dequantize + bf16": dequantized,
  }
  return impls, operands


def train_implementations() -> dict:
  """{name: fn(x, w, cotangent)}: a linear layer's forward + backward.

  The cotangent is an argument, not a constant of the jitted step, which XLA
  would fold (quantizing it at compile time)."""
  def step(layer):
    def run(x, w, cotangent):
      out, vjp = jax.vjp(layer, x, w)
      return out, *vjp(cotangent)
    return run

  return {TRAIN_BASELINE: step(jnp.dot), "train: ours bf16": step(matmul),
          "train: ours fp8_linear": step(fp8_linear),
          "train: ours fp8_linear, 2 warpgroups": step(
              functools.partial(fp8_linear, config=Fp8Config())),
          "train: ours fp8_linear, two blocks a step": step(
              functools.partial(fp8_linear, config=TWO_BLOCK_STEPS))}


def quantized_output_implementations() -> dict:
  """{name: fn(x, w)}: x @ w in bf16 with its output quantized in (1, 128)
  blocks, as (values, scales)."""
  return {
      QUANTIZED_BASELINE: lambda x, w: quantize_fp8_reference(jnp.dot(x, w), ROW_BLOCK),
      "quantized output: ours bf16, then quantize_fp8": lambda x, w: quantize_fp8(
          matmul(x, w), ROW_BLOCK),
      "quantized output: ours bf16, in the epilogue": functools.partial(
          matmul, out_dtype=FP8_DTYPE),
  }


def both_layouts_implementations(block: tuple[int, int]) -> dict:
  """{name: fn(a)}: `a` quantized in `block`s, as stored and transposed."""
  return {
      BOTH_LAYOUTS_BASELINE: lambda a: (quantize_fp8_reference(a, block),
                                        quantize_fp8_reference(a.T, block)),
      "quantize both layouts: ours, one read": functools.partial(
          quantize_fp8_both_layouts, block=block),
  }


def one_layout_implementations(block: tuple[int, int], transpose: bool) -> dict:
  """{name: fn(a)}: `a` (or a.T, with `transpose`) quantized in `block`s."""
  return {
      ONE_LAYOUT_BASELINE: lambda a: quantize_fp8_reference(a.T if transpose else a, block),
      "quantize one layout: ours, one read": functools.partial(
          quantize_fp8, block=block, transpose=transpose),
  }


def quantization_records(impls: dict, baseline: str, tensor: jax.Array, shape: str, *,
                         iterations: int, rounds: int) -> list[dict]:
  """Records of `impls` (`both_layouts_implementations` or
  `one_layout_implementations`) quantizing `tensor`, against `baseline`'s
  output. No FLOPs: their TFLOP/s are not meaningful, their times and ratios are."""
  return [dict(r, dtype="float8_e4m3fn", shape=shape, layout="NN")
          for r in timing.time_in_rounds(
              impls, (tensor,), flops=tensor.size, baseline=baseline,
              reference=impls[baseline](tensor), iterations=iterations, rounds=rounds).values()]


def bench_problem(m: int, k: int, n: int, *, train: bool, iterations: int,
                  rounds: int, quantized_output: bool = False,
                  both_layouts: bool = False, one_layout: bool = False) -> list[dict]:
  x, w = cli.random_operands(m, k, n, jnp.bfloat16)
  shape = dict(shape=f"{m}x{k}x{n}", layout="NN")
  impls, operands = forward_implementations(x, w)
  exact = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
  records = [dict(r, dtype="float8_e4m3fn", **shape) for r in timing.time_in_rounds(
      impls, (operands,), flops=2 * m * k * n, baseline=BASELINE, reference=exact,
      iterations=iterations, rounds=rounds).values()]
  if quantized_output:
    records += [dict(r, dtype="float8_e4m3fn", **shape) for r in timing.time_in_rounds(
        quantized_output_implementations(), (x, w), flops=2 * m * k * n,
        baseline=QUANTIZED_BASELINE, reference=quantize_fp8_reference(exact, ROW_BLOCK),
        iterations=iterations, rounds=rounds).values()]
  if both_layouts:
    for name, tensor, block in (("cotangent", cli.random_operands(m, n, 1, jnp.bfloat16)[0],
                                 ROW_BLOCK), ("weight", w, SQUARE_BLOCK)):
      records += quantization_records(
          both_layouts_implementations(block), BOTH_LAYOUTS_BASELINE, tensor,
          f"{m}x{k}x{n} ({name})", iterations=iterations, rounds=rounds)
  if one_layout:
    for name, tensor, block, transpose in (("activation", x, ROW_BLOCK, False),
                                           ("weight, transposed", w, SQUARE_BLOCK, True)):
      records += quantization_records(
          one_layout_implementations(block, transpose), ONE_LAYOUT_BASELINE, tensor,
          f"{m}x{k}x{n} ({name})", iterations=iterations, rounds=rounds)
  if train:
    cotangent = jax.random.normal(jax.random.key(2), (m, n), jnp.float32).astype(jnp.bfloat16)
    exact_grads = jax.vjp(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST),
                          x.astype(jnp.float32), w.astype(jnp.float32))
    reference = (exact_grads[0], *exact_grads[1](cotangent.astype(jnp.float32)))
    records += [dict(r, dtype="float8_e4m3fn", **shape) for r in timing.time_in_rounds(
        train_implementations(), (x, w, cotangent), flops=3 * 2 * m * k * n,
        baseline=TRAIN_BASELINE, reference=reference, iterations=iterations,
        rounds=rounds).values()]
  return records


def precision_records(k_values: list[int], m: int = 1024, n: int = 1024) -> list[dict]:
  """`fp8_matmul`'s error against the float32 product of its dequantized
  operands, with a float32 output, at each K: on each block-scaled kernel,
  with one scale per operand, and XLA's per-tensor FP8 GEMM; norm-wise
  (`rel_error`) and the largest of each element's error over the sum of its
  products' magnitudes (`magnitude_error`)."""
  one = jnp.float32(1.0)

  def xla_per_tensor(lhs, rhs, lhs_scale, rhs_scale):
    product = jax.lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    return product * (lhs_scale * rhs_scale)

  records = []
  for k in k_values:
    x, w = cli.random_operands(m, k, n, jnp.bfloat16)
    xq, xs = quantize_fp8(x, ROW_BLOCK)
    wq, ws = quantize_fp8(w, SQUARE_BLOCK, transpose=True)
    # Three compute warpgroups leave a float32 output's staging tile SMEM for 3 stages.
    configs = (Fp8Config(compute_wgs=1), Fp8Config(),
               Fp8Config(compute_wgs=3, max_concurrent_steps=3))
    cases = {f"fp8_matmul, compute_wgs={config.compute_wgs}": (
        functools.partial(fp8_matmul, out_dtype=jnp.float32, config=config),
        (xq, wq, xs, ws)) for config in configs}
    cases["fp8_matmul, one block per tile"] = (
        functools.partial(fp8_matmul, out_dtype=jnp.float32,
                          config=Fp8Config(persistent=False)), (xq, wq, xs, ws))
    cases["fp8_matmul, per-tensor"] = (functools.partial(fp8_matmul, out_dtype=jnp.float32),
                                       (xq, wq, one, one))
    cases["xla, per-tensor"] = (xla_per_tensor, (xq, wq, one, one))
    for name, (fn, args) in cases.items():
      lhs_dq = dequantize_fp8(args[0], args[2], ROW_BLOCK)
      rhs_dq = dequantize_fp8(args[1], args[3], SQUARE_BLOCK)
      exact = jnp.dot(lhs_dq, rhs_dq.T, precision=jax.lax.Precision.HIGHEST)
      magnitudes = jnp.dot(jnp.abs(lhs_dq), jnp.abs(rhs_dq).T,
                           precision=jax.lax.Precision.HIGHEST)
      out = jax.jit(fn)(*args)
      records.append(dict(
          kernel=f"precision: {name}", shape=f"{m}x{k}x{n}", layout="NN",
          dtype="float8_e4m3fn", rel_error=relative_error_on_device(out, exact),
          magnitude_error=float(jnp.max(jnp.abs(out - exact) / magnitudes))))
  return records


def summary(records: list[dict]) -> list[str]:
  """Each implementation's median ratio to its baseline over the problems."""
  lines = []
  for name in dict.fromkeys(r["kernel"] for r in records):
    ratios = [r["ratio_to_dot"] for r in records if r["kernel"] == name and "ratio_to_dot" in r]
    if ratios and name not in (BASELINE, TRAIN_BASELINE, QUANTIZED_BASELINE):
      lines.append(f"median ratio, {name}: {statistics.median(ratios):.3f} "
                   f"({len(ratios)} problems)")
  return lines


def main(argv):
  del argv
  problems = ([cli.parse_shape(s) for s in _SHAPES.value] if _SHAPES.value
              else default_problems(_MIN_M.value))
  if not has_gpu():
    raise SystemExit("bench_fp8 needs a Hopper GPU; none is visible to JAX.")
  out_dir = cli.output_dir(_OUT_DIR.value)
  path = os.path.join(out_dir, "fp8_bench.json")
  records = []
  for m, k, n in problems:
    records += bench_problem(m, k, n, train=_TRAIN.value, iterations=_ITERATIONS.value,
                             rounds=_ROUNDS.value, quantized_output=_QUANTIZED_OUTPUT.value,
                             both_layouts=_BOTH_LAYOUTS.value,
                             one_layout=_ONE_LAYOUT.value)
    report.write_json(path, records)  # After each problem, so a stopped run keeps them.
  if _PRECISION.value:
    records += precision_records([int(k) for k in _PRECISION_K.value])
    report.write_json(path, records)
  report.print_table(records, ["shape", "kernel", "median_us", "tflops", "ratio_to_dot",
                               "ratio_min", "ratio_max", "rel_error", "magnitude_error", "error"])
  for line in summary(records):
    print(line)
  cli.say_written([path])


if __name__ == "__main__":
  cli.run(main)
