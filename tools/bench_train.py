"""Benchmarks training steps of real layers: ours against XLA's autodiff and tokamax.

    bazel run //tools:bench_train -- --out_dir=/tmp/bench

For each layer and each layer size (the MLP shapes of published models, at a
prefill token count or a small one), on random normal bfloat16 data and a
random normal bfloat16 output cotangent, it times three passes:

  forward           `f(*params)`;
  backward          the VJP function applied to the cotangent, given the
                    residuals a jitted `jax.vjp(f, *params)` saved beforehand;
  forward_backward  one jitted `jax.vjp(f, *params)` then the VJP applied to
                    the cotangent: the output and every gradient, a training
                    step's work for this layer.

The layers (`--layers`): `linear` (x @ w), `bias_gelu` and `bias_silu`
(act(x @ w + b), gelu in its tanh approximation), `glu` (act(x @ w_gate) *
(x @ w_up), with the model's activation; `glu_silu` or `glu_gelu` pick one)
and `mlp` (the whole block, glu then the down projection). Linear and bias
layers take the up projection's shape, (tokens, hidden) @ (hidden,
intermediate).

The implementations, timed in the same process, taking turns:
  xla      the model as a user writes it in bfloat16 (`x @ w`, `jax.nn.gelu(...,
           approximate=True)`, `jax.nn.silu`), differentiated by XLA's autodiff;
  ours     `pipelines.matmul` (fused bias and activation, a custom VJP) and
           `pipelines.gated_linear_unit`; the block is
           `matmul(gated_linear_unit(x, w_gate, w_up), w_down)`;
  tokamax  `tokamax.gated_linear_unit(x, w (K, 2, N), implementation="mosaic")`
           for glu and mlp (its down projection is `jnp.dot`), where tokamax
           imports (it is not in the lock files: put it on PYTHONPATH, see
           `../shared/tools/peer_site.sh`); skipped with a note otherwise.

Each time is the median over `--iterations` CUPTI-timed calls after warm-up;
the implementations take turns for `--rounds` rounds (a GPU's clock drifts
under sustained load, so each round's ratio compares calls seconds apart) and
the reported ratio to xla is the median of the rounds' ratios, with their
range (`core.timing.compare_rounds`; above 1 is faster than XLA). Each record
also lists the kernels CUPTI saw in one call, in launch order, with their
median times. `core.timing.time_gpu` reports only a call's total, so the
per-kernel measurement is `measure_calls` here.

Precision: the output and every gradient of each pass are compared, norm-wise
(`core.numerics.relative_error_on_device`), with a float32 reference of the
same model: the same parameters upcast to float32, a float32 cotangent of the
same values, jax autodiff with matmuls at precision HIGHEST. XLA's own
bfloat16 error is in the xla records, beside ours.

Writes `train_bench.json` and `train_bench.png` to `--out_dir`. Needs a
Hopper GPU, except `--quick`, which runs tiny layers and, without a GPU, runs
the kernels in Mosaic GPU's interpret mode and times them by wall clock (the
times then only show that the path runs).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import flags

import pipelines
from core import device_facts, has_gpu, timing
from core.numerics import relative_error_on_device
from tools import cli, report


@dataclasses.dataclass(frozen=True)
class Model:
  """The MLP of a published model config (its Hugging Face config.json)."""

  name: str
  hidden: int
  intermediate: int
  activation: str  # Of the gated unit: "silu" (SwiGLU) or "gelu" (tanh approximation).


MODELS = {
    "llama3-8b": Model("Llama-3-8B", 4096, 14336, "silu"),
    "mistral-7b": Model("Mistral-7B", 4096, 14336, "silu"),  # Llama-3-8B's MLP shape.
    "llama3-70b": Model("Llama-3-70B", 8192, 28672, "silu"),
    "llama3.2-1b": Model("Llama-3.2-1B", 2048, 8192, "silu"),
    "qwen2.5-7b": Model("Qwen2.5-7B", 3584, 18944, "silu"),
    "qwen2.5-14b": Model("Qwen2.5-14B", 5120, 13824, "silu"),
    # hidden_activation "gelu_pytorch_tanh": gelu's tanh approximation.
    "gemma2-9b": Model("Gemma-2-9B", 3584, 14336, "gelu"),
    "tiny": Model("tiny (smoke test)", 128, 256, "silu"),
}
# Four prefill sizes and two small token counts (a decode batch, a short
# fine-tuning micro-batch). Measured on one H200 (2026-12-02,
# perf/2026-12-02-h200-training-layers.json): 268 s for the five layers at four of
# these sizes with two passes, 10 iterations and 2 rounds, 16 s a layer and size,
# the gated unit and the MLP block 23-27 s each. So the full default run (three
# passes, 5 iterations, 6 rounds) takes well over ten minutes: where a run must
# fit a time limit, give each run two or three of the sizes (`--sizes`). Most of it
# is compiling, about 300 programs (per layer, size and implementation the three
# passes and the backward's residuals), which share their kernels: Mosaic GPU
# compiles each kernel once per process (keyed by its hash) and XLA autotunes each
# GEMM once. `elapsed_s` in the JSON says where the time went.
DEFAULT_SIZES = ("llama3-8b@8192", "qwen2.5-7b@8192", "gemma2-9b@8192", "llama3.2-1b@16384",
                 "llama3-70b@256", "qwen2.5-14b@512")
QUICK_SIZES = ("tiny@128",)

LAYER_KINDS = ("linear", "bias", "glu", "mlp")
DEFAULT_LAYERS = ("linear", "bias_gelu", "bias_silu", "glu", "mlp")
IMPLEMENTATIONS = ("xla", "ours", "tokamax")
PASSES = ("forward", "backward", "forward_backward")
BASELINE = "xla"
# The activations as a user writes them in jax, for the xla model, the reference and
# tokamax. jax.nn.gelu's default is the tanh approximation (approximate=True), as
# ours is; the plain function (not a partial) is what tokamax can serialize into
# its HLO metadata (an importable name).
JAX_ACTIVATIONS = {"gelu": jax.nn.gelu, "silu": jax.nn.silu}
# Warm-up calls before each round's measurement: the other implementations ran
# in between.
WARMUP_CALLS = 2
# Long kernel names (cuBLAS's) are cut here in the JSON.
KERNEL_NAME_CHARS = 160
# The one "kernel" of a call whose calls launched different kernels (total time only).
INCONSISTENT_KERNELS = "all kernels (calls launched different kernels: total only)"

_SIZES = flags.DEFINE_list(
    "sizes", None, "Layer sizes as MODEL@TOKENS (models: " + ", ".join(MODELS) + "); "
    "default: " + ",".join(DEFAULT_SIZES) + ".")
_LAYERS = flags.DEFINE_list(
    "layers", list(DEFAULT_LAYERS), "Layers: linear, bias_gelu, bias_silu, glu, glu_silu, "
    "glu_gelu, mlp, mlp_silu, mlp_gelu (glu and mlp take the model's activation).")
_IMPLS = flags.DEFINE_list("impls", list(IMPLEMENTATIONS),
                           "Implementations: " + ", ".join(IMPLEMENTATIONS) + ".")
_PASSES = flags.DEFINE_list("passes", list(PASSES), "Passes: " + ", ".join(PASSES) + ".")
# Short turns, many of them: at the 700 W cap an H200's clock moves by up to
# 10% within seconds, so a long turn times one implementation at one clock and
# the next at another (the 2026-12-04 runs of 10 calls in 2 rounds spread their
# rounds' ratios over 0.88-0.97 where 5 calls in 6 rounds gave 0.99 on the same
# step: docs/performance-log.md, "Training steps and the clock").
_ITERATIONS = flags.DEFINE_integer("iterations", 5, "Timed calls per implementation and round.",
                                   lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 6, "Rounds in which the implementations take turns.",
                               lower_bound=1)
_QUICK = flags.DEFINE_bool(
    "quick", False, "Tiny layers (" + ",".join(QUICK_SIZES) + ") unless --sizes is given, 2 "
    "iterations and 2 rounds unless given; runs without a GPU (interpret mode, wall clock).")
_OUT_DIR = flags.DEFINE_string("out_dir", os.environ.get("OUT", "out"),
                               "Where results go; relative to where the command ran.")


@dataclasses.dataclass(frozen=True)
class LayerSize:
  """A model's MLP at a token count."""

  key: str
  model: Model
  tokens: int

  @property
  def name(self) -> str:
    return f"{self.key}@{self.tokens}"


def parse_size(text: str) -> LayerSize:
  """"llama3-8b@8192" -> LayerSize; raises ValueError naming what is valid."""
  key, _, tokens = text.partition("@")
  if key not in MODELS:
    raise ValueError(f"size {text!r}: unknown model {key!r}; models: {', '.join(MODELS)}")
  try:
    count = int(tokens)
  except ValueError:
    count = 0
  if count < 1:
    raise ValueError(f"size {text!r} must be MODEL@TOKENS with TOKENS a positive integer")
  return LayerSize(key, MODELS[key], count)


@dataclasses.dataclass(frozen=True)
class Layer:
  """What is computed: `kind` with `activation` ("none" for linear; None for
  glu and mlp means the model's)."""

  name: str
  kind: str
  activation: str | None


def parse_layer(text: str) -> Layer:
  kind, _, activation = text.partition("_")
  valid = kind in LAYER_KINDS and activation in ("", *JAX_ACTIVATIONS)
  valid &= not (kind == "linear" and activation) and not (kind == "bias" and not activation)
  if not valid:
    raise ValueError(f"layer {text!r} must be one of linear, bias_gelu, bias_silu, glu, "
                     "glu_silu, glu_gelu, mlp, mlp_silu, mlp_gelu")
  if kind == "linear":
    activation = "none"
  return Layer(text, kind, activation or None)


PARAM_NAMES = {"linear": ("x", "w"), "bias": ("x", "w", "b"), "glu": ("x", "w_gate", "w_up"),
               "mlp": ("x", "w_gate", "w_up", "w_down")}
FORMULAS = {"linear": "x @ w", "bias": "{act}(x @ w + b)",
            "glu": "{act}(x @ w_gate) * (x @ w_up)",
            "mlp": "({act}(x @ w_gate) * (x @ w_up)) @ w_down"}


def param_shapes(kind: str, size: LayerSize) -> dict[str, tuple[int, ...]]:
  t, h, i = size.tokens, size.model.hidden, size.model.intermediate
  shapes = {"x": (t, h), "w": (h, i), "b": (i,), "w_gate": (h, i), "w_up": (h, i),
            "w_down": (i, h)}
  return {name: shapes[name] for name in PARAM_NAMES[kind]}


def model_flops(kind: str, size: LayerSize) -> int:
  """The forward's matmul FLOPs (the backward's are twice these); no recompute counted."""
  t, h, i = size.tokens, size.model.hidden, size.model.intermediate
  matmuls = {"linear": 1, "bias": 1, "glu": 2, "mlp": 3}[kind]
  return 2 * t * h * i * matmuls


def random_params(kind: str, size: LayerSize, dtype=jnp.bfloat16) -> tuple[jax.Array, ...]:
  """Random normal parameters; weights scaled by 1/sqrt(fan in), as at initialization,
  so pre-activations are of order 1, where the activation's curve (and its
  derivative's) matters rather than only its sign."""
  params = []
  for seed, (name, shape) in enumerate(param_shapes(kind, size).items()):
    values = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    if name.startswith("w"):
      values = values / math.sqrt(shape[0])
    params.append(values.astype(dtype))
  return tuple(params)


def jax_model(kind: str, activation: str, dot: Callable) -> Callable:
  """The layer as jax code, on the dtype it is given: the xla implementation
  (bfloat16, `jnp.matmul`) and the float32 reference (`dot` at HIGHEST)."""
  act = JAX_ACTIVATIONS.get(activation)
  match kind:
    case "linear":
      return lambda x, w: dot(x, w)
    case "bias":
      return lambda x, w, b: act(dot(x, w) + b)
    case "glu":
      return lambda x, w_gate, w_up: act(dot(x, w_gate)) * dot(x, w_up)
  return lambda x, w_gate, w_up, w_down: dot(act(dot(x, w_gate)) * dot(x, w_up), w_down)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """A layer as one implementation computes it, on its own parameters.

  `pack` turns the canonical parameters (`PARAM_NAMES`) into `fn`'s (before
  timing), `unpack_grads` its gradients back (for the comparison).
  """

  fn: Callable
  detail: str
  pack: Callable[[tuple], tuple] = lambda params: params
  unpack_grads: Callable[[tuple], tuple] = lambda grads: grads


def _ours(kind: str, activation: str) -> Implementation:
  """Ours."""
  if kind in ("linear", "bias"):
    fn = (pipelines.matmul if kind == "linear"
          else functools.partial(pipelines.matmul, activation=activation))
    return Implementation(fn, "pipelines.matmul" + ("" if kind == "linear" else
                                                    f"(activation={activation!r})"))
  glu = functools.partial(pipelines.gated_linear_unit, activation=activation)
  if kind == "glu":
    return Implementation(glu, f"pipelines.gated_linear_unit(activation={activation!r})")
  return Implementation(lambda x, w_gate, w_up, w_down: pipelines.matmul(glu(x, w_gate, w_up),
                                                                         w_down),
                        f"pipelines.matmul(pipelines.gated_linear_unit(activation="
                        f"{activation!r}), w_down)")


def _tokamax(kind: str, activation: str) -> Implementation | str:
  """tokamax's Mosaic GPU gated unit, or why it is skipped. Imported here: it is
  only on the GPU machine's PYTHONPATH, and it imports qwix (flax) and xprof."""
  if kind not in ("glu", "mlp"):
    return "tokamax has no such layer (it has the gated unit only)"
  try:
    import tokamax  # noqa: PLC0415
  except Exception as e:  # Any failure to import skips the peer, not the benchmark.
    return f"tokamax is not importable ({type(e).__name__}: {e})"[:300]
  glu = functools.partial(tokamax.gated_linear_unit, activation=JAX_ACTIVATIONS[activation],
                          implementation="mosaic")
  # tokamax's Mosaic kernel takes the fused (K, 2, N) weight; stacking unfused
  # weights would be a copy inside the timed call that a user of it would not have.
  def pack(params):
    x, w_gate, w_up, *rest = params
    return (x, jnp.stack([w_gate, w_up], axis=1), *rest)

  def unpack_grads(grads):
    d_x, d_w, *rest = grads
    return (d_x, d_w[:, 0], d_w[:, 1], *rest)

  detail = (f"tokamax.gated_linear_unit(activation={activation}, implementation='mosaic', "
            f"fused (K, 2, N) weight)")
  if kind == "glu":
    return Implementation(glu, detail, pack, unpack_grads)
  return Implementation(lambda x, w, w_down: jnp.dot(glu(x, w), w_down),
                        detail + " then jnp.dot for w_down", pack, unpack_grads)


def implementations(kind: str, activation: str, names) -> dict[str, Implementation | str]:
  """Each implementation asked for: an `Implementation`, or why it is skipped."""
  built = {}
  for name in names:
    if name == "xla":
      built[name] = Implementation(jax_model(kind, activation, jnp.matmul),
                                   "jnp.matmul and jax.nn in bfloat16, XLA autodiff")
    elif name == "ours":
      built[name] = _ours(kind, activation)
    else:
      built[name] = _tokamax(kind, activation)
  return built


def reference(kind: str, activation: str, params, cotangent):
  """(output, gradients) of the float32 model at precision HIGHEST."""
  dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
  model = jax_model(kind, activation, dot)

  @jax.jit
  def step(params, cotangent):
    params = [p.astype(jnp.float32) for p in params]
    out, vjp = jax.vjp(model, *params)
    return out, vjp(cotangent.astype(jnp.float32))
  return step(params, cotangent)


def pass_program(pass_name: str, fn: Callable, params: tuple, cotangent):
  """(function, arguments) of one pass of `fn`.

  The backward's residuals come from a jitted `jax.vjp` run here, before
  timing. The forward + backward returns the output as well as the gradients:
  without it XLA would drop a forward product that no gradient needs (all of
  it, for a linear layer), which a training step never could.
  """
  if pass_name == "forward":
    return fn, params
  if pass_name == "backward":
    residuals = jax.jit(lambda *p: jax.vjp(fn, *p)[1])(*params)
    return (lambda vjp, ct: vjp(ct)), (residuals, cotangent)

  def forward_backward(*args):
    *p, ct = args
    out, vjp = jax.vjp(fn, *p)
    return out, vjp(ct)
  return forward_backward, (*params, cotangent)


def measure_calls(jitted, args, iterations: int) -> list[list[tuple[str, float]]]:
  """`iterations` calls of `jitted(*args)`: per call, (kernel name, microseconds) of
  each kernel it launched, in launch order.

  On a GPU, after `WARMUP_CALLS` calls, these are CUPTI's kernel records (Mosaic GPU's profiler, as
  `core.timing.time_gpu` uses it, without summing the kernels). Without one
  (`--quick` in interpret mode) each call is one wall-clock entry.
  """
  if not has_gpu():  # Interpret mode: warm-up calls would only cost time.
    calls = []
    for _ in range(iterations):
      start = time.perf_counter()
      jax.block_until_ready(jitted(*args))
      calls.append([("whole call (wall clock, no GPU)", (time.perf_counter() - start) * 1e6)])
    return calls
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 - needs CUDA.

  for _ in range(WARMUP_CALLS):
    jax.block_until_ready(jitted(*args))
  try:
    _, per_call = profiler.measure(jitted, aggregate=False, iterations=iterations)(*args)
  except RuntimeError as e:
    if "not consistent" not in str(e):
      raise
    # The profiler splits the records into calls by position, so it refuses calls that
    # launch different kernels; their totals are still each call's time.
    _, totals = profiler.measure(jitted, iterations=iterations)(*args)
    totals = [totals] if iterations == 1 else totals
    return [[(INCONSISTENT_KERNELS, ms * 1e3)] for ms in totals]
  if per_call is None:
    raise RuntimeError("no GPU kernel was launched")
  if iterations == 1:  # The profiler returns the one call's list itself.
    per_call = [per_call]
  return [[(name, ms * 1e3) for name, ms in call] for call in per_call]


def kernel_breakdown(calls: list[list[tuple[str, float]]]) -> list[dict]:
  """Each kernel of one call, in launch order, with its median time over `calls`
  (those of every round, while every call launched the same kernels)."""
  names = [name for name, _ in calls[0]]
  same = [c for c in calls if [name for name, _ in c] == names]
  return [dict(name=name[:KERNEL_NAME_CHARS],
               median_us=statistics.median(call[i][1] for call in same))
          for i, name in enumerate(names)]


def _relative_errors(names: tuple[str, ...], got, want) -> dict[str, float]:
  return {name: relative_error_on_device(g, w)
          for name, g, w in zip(names, got, want, strict=True)}


def _errors(pass_name: str, impl: Implementation, param_names, out, ref) -> dict[str, float]:
  """Relative error of each value a pass returns: "out" and "d_<param>"."""
  ref_out, ref_grads = ref
  grad_names = tuple(f"d_{name}" for name in param_names)
  if pass_name == "forward":
    return _relative_errors(("out",), (out,), (ref_out,))
  if pass_name == "backward":
    return _relative_errors(grad_names, impl.unpack_grads(tuple(out)), ref_grads)
  fb_out, grads = out
  return _relative_errors(("out", *grad_names), (fb_out, *impl.unpack_grads(tuple(grads))),
                          (ref_out, *ref_grads))


def _time_pass(pass_name: str, impls: dict[str, Implementation], packed: dict, cotangent,
               ref, *, param_names, flops: int, iterations: int, rounds: int) -> dict[str, dict]:
  """One pass of every implementation, taking turns for `rounds` rounds; records by name."""
  records, programs, calls, timings = {}, {}, {}, {}
  for name, impl in impls.items():
    try:
      fn, args = pass_program(pass_name, impl.fn, packed[name], cotangent)
      jitted = jax.jit(fn)
      start = time.perf_counter()
      out = jax.block_until_ready(jitted(*args))
      compile_s = time.perf_counter() - start
      errors = _errors(pass_name, impl, param_names, out, ref)
      del out
    except Exception as e:  # Report an implementation that fails; keep the others.
      records[name] = dict(error=f"{type(e).__name__}: {e}"[:500])
      continue
    records[name] = dict(compile_s=compile_s, rel_error=errors,
                         rel_error_max=max(errors.values()))
    programs[name] = (jitted, args)
    calls[name], timings[name] = [], []
  for _ in range(rounds):
    for name, (jitted, args) in list(programs.items()):
      try:
        round_calls = measure_calls(jitted, args, iterations)
      except Exception as e:
        records[name] = dict(records[name], error=f"{type(e).__name__}: {e}"[:500])
        del programs[name]
        continue
      calls[name] += round_calls
      timings[name].append(timing.Timing(
          name=name, config="", compile_s=records[name]["compile_s"], flops=flops,
          times_us=tuple(sum(us for _, us in call) for call in round_calls)))
  for name in programs:
    record = records[name]
    record.update(median_us=statistics.median(t.median_us for t in timings[name]),
                  round_median_us=[t.median_us for t in timings[name]],
                  call_us=[[round(us, 2) for us in t.times_us] for t in timings[name]],
                  kernels=kernel_breakdown(calls[name]))
    record["tflops"] = flops / (record["median_us"] * 1e-6) / 1e12
    if BASELINE in programs:
      summary = timing.compare_rounds(timings[name], timings[BASELINE])
      record.update(ratio_to_xla=summary["ratio"], ratio_min=summary["ratio_min"],
                    ratio_max=summary["ratio_max"])
  return records


def bench_layer(layer: Layer, size: LayerSize, *, impl_names, pass_names, iterations: int,
                rounds: int) -> tuple[list[dict], list[str]]:
  """Every pass of every implementation of one layer at one size: (records, notes)."""
  activation = layer.activation or size.model.activation
  params = random_params(layer.kind, size)
  out_shape = (size.tokens, size.model.hidden if layer.kind == "mlp" else size.model.intermediate)
  cotangent = jax.random.normal(jax.random.key(100), out_shape, jnp.float32).astype(jnp.bfloat16)
  ref = reference(layer.kind, activation, params, cotangent)
  param_names = PARAM_NAMES[layer.kind]
  common = dict(layer=layer.name, activation=activation,
                formula=FORMULAS[layer.kind].format(act=activation), size=size.name,
                model=size.model.name, tokens=size.tokens, hidden=size.model.hidden,
                intermediate=size.model.intermediate,
                shapes={k: list(v) for k, v in param_shapes(layer.kind, size).items()},
                iterations=iterations, rounds=rounds)
  records, notes, impls, packed = [], [], {}, {}
  for name, impl in implementations(layer.kind, activation, impl_names).items():
    if isinstance(impl, str):
      notes.append(f"{layer.name} {size.name}: {name} skipped: {impl}")
      records.extend(dict(common, impl=name, **{"pass": p}, skipped=impl) for p in pass_names)
    else:
      impls[name] = impl
      packed[name] = impl.pack(params)
  forward_flops = model_flops(layer.kind, size)
  for pass_name in pass_names:
    flops = forward_flops * {"forward": 1, "backward": 2, "forward_backward": 3}[pass_name]
    by_impl = _time_pass(pass_name, impls, packed, cotangent, ref, param_names=param_names,
                         flops=flops, iterations=iterations, rounds=rounds)
    records.extend(dict(common, impl=name, detail=impls[name].detail, **{"pass": pass_name},
                        model_flops=flops, **record) for name, record in by_impl.items())
  return records, notes


def _device_name() -> str:
  if has_gpu():
    return device_facts().name
  return f"{jax.devices()[0].device_kind} (no GPU)"


_COLUMNS = ["layer", "size", "pass", "impl", "median_us", "tflops", "ratio_to_xla", "ratio_min",
            "ratio_max", "rel_error_max", "error", "skipped"]


def run(sizes: list[LayerSize], layers: list[Layer], *, impl_names, pass_names,
        iterations: int, rounds: int, json_path: str | None = None) -> dict:
  """The whole benchmark: the JSON document (see `main`).

  With `json_path`, the document so far is written there after each layer,
  so a run cut short keeps what it measured.
  """
  start = time.perf_counter()
  records, notes, elapsed = [], [], {}

  def document():
    return dict(device=_device_name(), jax_version=jax.__version__,
                timer="CUPTI kernel time" if has_gpu() else "wall clock (no GPU: interpret mode)",
                baseline=BASELINE, iterations=iterations, rounds=rounds, notes=notes,
                elapsed_s=dict(elapsed, total=time.perf_counter() - start), records=records)

  for size in sizes:
    for layer in layers:
      section = time.perf_counter()
      got, got_notes = bench_layer(layer, size, impl_names=impl_names, pass_names=pass_names,
                                   iterations=iterations, rounds=rounds)
      for note in got_notes:
        print(f"note: {note}")
      records += got
      notes += got_notes
      elapsed[f"{layer.name} {size.name}"] = time.perf_counter() - section
      report.print_table(got, _COLUMNS)
      print(f"{layer.name} {size.name}: {elapsed[f'{layer.name} {size.name}']:.1f} s", flush=True)
      if json_path is not None:
        with open(json_path, "w") as f:
          json.dump(document(), f, indent=1)
  return document()


def plot(records: list[dict], path: str) -> None:
  """One panel per pass of each implementation's speed ratio to xla, per layer and
  size, and one of every implementation's largest relative error (the output
  and the gradients of forward_backward, or of the last pass run)."""
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  timed = [r for r in records if "ratio_to_xla" in r]
  passes = [p for p in PASSES if any(r["pass"] == p for r in timed)]
  error_pass = next((p for p in reversed(PASSES) if any(r["pass"] == p for r in records)),
                    "forward_backward")
  groups = sorted({(r["layer"], r["size"]) for r in records})
  impls = [i for i in IMPLEMENTATIONS if any(r["impl"] == i for r in records)]
  fig, axes = plt.subplots(len(passes) + 1, 1, squeeze=False,
                           figsize=(max(8, len(groups) * 0.7), 3.0 * (len(passes) + 1)))
  width = 0.8 / max(len(impls), 1)
  xs = range(len(groups))

  def bars(ax, key: str, pass_name: str, names):
    for i, impl in enumerate(names):
      # NaN draws no bar (a skipped or failed implementation), on a log scale too.
      ys = [next((r[key] for r in records if key in r and
                  (r["layer"], r["size"], r["pass"], r["impl"]) == (*g, pass_name, impl)),
                 math.nan) for g in groups]
      ax.bar([x + i * width for x in xs], ys, width, label=impl)
    ax.set_xticks([x + 0.4 - width / 2 for x in xs])
    ax.set_xticklabels([f"{layer}\n{size}" for layer, size in groups], fontsize=6)
    ax.legend(fontsize=7)

  for ax, pass_name in zip(axes[:-1, 0], passes, strict=True):
    bars(ax, "ratio_to_xla", pass_name, [i for i in impls if i != BASELINE])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("speed / xla")
    ax.set_title(pass_name, fontsize=9)
  ax = axes[-1, 0]
  bars(ax, "rel_error_max", error_pass, impls)
  ax.set_yscale("log")
  ax.set_ylabel("relative error")
  ax.set_title(f"{error_pass}: largest relative error against float32", fontsize=9)
  fig.suptitle(f"training passes on {_device_name()}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def _checked(values, valid, what: str) -> list[str]:
  for value in values:
    if value not in valid:
      raise ValueError(f"{what} {value!r} must be one of {', '.join(valid)}")
  return list(values)


def main(argv):
  del argv
  quick = _QUICK.value
  if not quick and not has_gpu():
    raise SystemExit("bench_train needs a Hopper GPU; none is visible to JAX (--quick runs "
                     "tiny layers in interpret mode).")
  size_texts = _SIZES.value or list(QUICK_SIZES if quick else DEFAULT_SIZES)
  sizes = [parse_size(text) for text in size_texts]
  layers = [parse_layer(text) for text in _LAYERS.value]
  impl_names = _checked(_IMPLS.value, IMPLEMENTATIONS, "implementation")
  pass_names = _checked(_PASSES.value, PASSES, "pass")
  # The baseline is timed whenever anything is, so every ratio has its round.
  if BASELINE not in impl_names:
    impl_names.insert(0, BASELINE)
  iterations, rounds = _ITERATIONS.value, _ROUNDS.value
  if quick:
    iterations = iterations if flags.FLAGS["iterations"].present else 2
    rounds = rounds if flags.FLAGS["rounds"].present else 2
  if iterations < 1 or rounds < 1:
    raise ValueError(f"--iterations={iterations} and --rounds={rounds} must be >= 1")
  out_dir = cli.output_dir(_OUT_DIR.value)
  json_path, png_path = (os.path.join(out_dir, name)
                         for name in ("train_bench.json", "train_bench.png"))
  doc = run(sizes, layers, impl_names=impl_names, pass_names=pass_names,
            iterations=iterations, rounds=rounds, json_path=json_path)
  report.print_table(doc["records"], _COLUMNS)
  for impl in impl_names:
    for pass_name in pass_names:
      ratios = [r["ratio_to_xla"] for r in doc["records"]
                if r["impl"] == impl and r["pass"] == pass_name and "ratio_to_xla" in r]
      if ratios and impl != BASELINE:
        print(f"median ratio to xla, {impl} {pass_name}: {statistics.median(ratios):.3f} "
              f"({len(ratios)} layers)")
  print(f"total {doc['elapsed_s']['total']:.0f} s")
  with open(json_path, "w") as f:
    json.dump(doc, f, indent=1)
  report.write_plot(plot, doc["records"], png_path)
  cli.say_written([json_path, png_path])


if __name__ == "__main__":
  cli.run(main)
