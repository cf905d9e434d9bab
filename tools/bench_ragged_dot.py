"""Benchmarks the grouped matmul of MoE layers: ours against dense, XLA and the Pallas peers.

    bazel run //tools:bench_ragged_dot -- --out_dir=/tmp/bench

For each MoE layer (the expert up projection of published models, at a
training token count or a decode-size one; `--half` picks the fit half,
whose layers the tile rules were set on, the held-back check half, or both)
and routing (`balanced`: equal groups; `skewed`: sizes from a fixed
Dirichlet(0.3) draw, some nearly empty; and, only when asked for,
`one_group`: every row in the first group, which isolates what the grouped
kernel costs over `ours_dense`), on random
normal bfloat16 data, it times with CUPTI after warm-up, in the same process:
  dense     `jnp.dot` of the same (M, K) x (K, N) FLOPs (the baseline)
  xla       `jax.lax.ragged_dot`
  ours      `pipelines.ragged_dot`
  ours_dense  `pipelines.matmul` on dense's problem with `ragged_dot`'s
            default config: the dense kernel on the grouped one's tiles
            (forward only)
  tokamax   `tokamax.ragged_dot(..., implementation="mosaic")`, where
            tokamax imports (put it on PYTHONPATH: ../shared/tools/peer_site.sh)
  jax_mgpu  JAX's shipped `ragged_dot_mgpu`, the best of a small sweep of its
            tiles (forward only: it has no gradient)
the forward and (`--passes`) the forward + backward (d lhs and d rhs from a
bf16 cotangent; dense's is `jnp.dot`'s), and the weight gradient alone
(`weight_gradient`: each group's `lhs_g.T @ cotangent_g`, (G, K, N); dense's
is `jnp.dot(lhs.T, cotangent)`, XLA's `jax.lax.ragged_dot`'s transpose,
jax_mgpu JAX's shipped `transposed_ragged_dot` at the best of its sweep).
Each record has the time, TFLOP/s (2 M K N per product, the useful work),
the ratio to dense's TFLOP/s and the relative error of the forward, or of
the weight gradient, against float32.

Writes `ragged_dot_bench.json` to `--out_dir`. Needs a Hopper GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from core import has_gpu
from core.numerics import relative_error_on_device
from core.timing import time_gpu
from pipelines import matmul, operands, ragged_dot
from pipelines.ragged_dot import default_config, weight_gradient
from tools import cli, model_shapes, report


@dataclasses.dataclass(frozen=True)
class MoeLayer:
  """An MoE layer's expert up projection: M routed rows (tokens x experts per
  token) over G experts of (K, N) weights, from a model of `family`."""

  name: str
  family: str
  m: int
  k: int
  n: int
  groups: int

  @property
  def half(self) -> str:
    """"fit" or "check": which half of the layers (`layer_half`)."""
    return layer_half(self.family)


# The layers' families are split like the models suite's (`model_shapes.FIT_FAMILIES`,
# `CHECK_FAMILIES`) where that suite has the family; the families only MoE layers come
# from are split here. The tile rules of `ragged_dot` were set on the fit half's layers;
# the check half's were added after them and are only measured. (DeepSeek-V2-Lite's layer
# was in the benchmark while those rules were set: its family is held back in the models
# suite, so it is in the check half here too, though no rule was fitted on it alone.)
MOE_ONLY_FIT_FAMILIES = ("DBRX",)
MOE_ONLY_CHECK_FAMILIES = ("Grok-1", "Qwen3-MoE", "OLMoE")
HALVES = model_shapes.HALVES


def layer_half(family: str) -> str:
  """"fit" or "check" for an MoE layer's model family; raises ValueError for a
  family in neither half."""
  if family in MOE_ONLY_FIT_FAMILIES:
    return "fit"
  if family in MOE_ONLY_CHECK_FAMILIES:
    return "check"
  return model_shapes.family_half(family)


# Hidden size, expert intermediate size and experts from each model's
# published config; M = tokens x experts per token.
LAYERS = (
    # Fit half.
    MoeLayer("mixtral-8x7b@8192", "Mixtral", m=16384, k=4096, n=14336, groups=8),
    MoeLayer("mixtral-8x22b@4096", "Mixtral", m=8192, k=6144, n=16384, groups=8),
    MoeLayer("dbrx@4096", "DBRX", m=16384, k=6144, n=10752, groups=16),
    MoeLayer("qwen1.5-moe@4096", "Qwen1.5-MoE", m=16384, k=2048, n=1408, groups=60),
    MoeLayer("mixtral-8x7b@32", "Mixtral", m=64, k=4096, n=14336, groups=8),
    MoeLayer("qwen1.5-moe@64", "Qwen1.5-MoE", m=256, k=2048, n=1408, groups=60),
    # Check half: few large experts, many small ones, and decode, like the fit half.
    # xai-org/grok-1 (hidden 6144, 8 experts, 2 a token, FFN 32768).
    MoeLayer("grok-1@2048", "Grok-1", m=4096, k=6144, n=32768, groups=8),
    # Qwen/Qwen3-235B-A22B (hidden 4096, 128 experts of 1536, 8 a token).
    MoeLayer("qwen3-235b-a22b@4096", "Qwen3-MoE", m=32768, k=4096, n=1536, groups=128),
    # allenai/OLMoE-1B-7B-0924 (hidden 2048, 64 experts of 1024, 8 a token).
    MoeLayer("olmoe-1b-7b@4096", "OLMoE", m=32768, k=2048, n=1024, groups=64),
    # deepseek-ai/DeepSeek-V2 (hidden 5120, 160 routed experts of 1536, 6 a token).
    MoeLayer("deepseek-v2@4096", "DeepSeek-V2", m=24576, k=5120, n=1536, groups=160),
    # deepseek-ai/DeepSeek-V2-Lite (hidden 2048, 64 routed experts of 1408, 6 a token).
    MoeLayer("deepseek-v2-lite@4096", "DeepSeek-V2", m=24576, k=2048, n=1408, groups=64),
    # Qwen/Qwen3-30B-A3B (hidden 2048, 128 experts of 768, 8 a token).
    MoeLayer("qwen3-30b-a3b@4096", "Qwen3-MoE", m=32768, k=2048, n=768, groups=128),
    MoeLayer("grok-1@32", "Grok-1", m=64, k=6144, n=32768, groups=8),
    MoeLayer("qwen3-30b-a3b@32", "Qwen3-MoE", m=256, k=2048, n=768, groups=128),
)
ROUTINGS = ("balanced", "skewed", "one_group")
IMPLS = ("dense", "xla", "ours", "tokamax", "jax_mgpu", "ours_dense")
PASSES = ("forward", "forward_backward", "weight_gradient")
# JAX's ragged_dot_mgpu tiles tried (block_m, block_n, block_k, steps, grid_block_n).
JAX_MGPU_SWEEP = ((128, 128, 64, 4, 1), (128, 256, 64, 4, 1), (64, 128, 64, 5, 4),
                  (128, 128, 64, 6, 8))

_OUT_DIR = flags.DEFINE_string("out_dir", "out", "Where results go; relative to where the "
                               "command ran.")
_HALF = flags.DEFINE_enum("half", "all", [*HALVES, "all"],
                          "The layers of one half (fit: the tile rules were set on them; check: "
                          "held back), or all; --layers overrides it.")
_LAYERS = flags.DEFINE_list("layers", None, "MoE layers to time (default: those of --half): "
                            + ", ".join(layer.name for layer in LAYERS) + ".")
_ROUTINGS = flags.DEFINE_list("routings", ["balanced", "skewed"],
                              "Routings: " + ", ".join(ROUTINGS) + ".")
_IMPLS = flags.DEFINE_list("impls", [impl for impl in IMPLS if impl != "ours_dense"],
                           "Implementations to time: " + ", ".join(IMPLS) + ".")
_PASSES = flags.DEFINE_list("passes", list(PASSES), "Passes: " + ", ".join(PASSES) + ".")
_ITERATIONS = flags.DEFINE_integer("iterations", 20, "Timed calls per implementation.",
                                   lower_bound=1)


def group_sizes(layer: MoeLayer, routing: str) -> np.ndarray:
  """(G,) int32 sizes summing to M: equal, a fixed Dirichlet(0.3) split, or
  every row in the first group."""
  if routing == "balanced":
    sizes = np.full(layer.groups, layer.m // layer.groups)
  elif routing == "skewed":
    shares = np.random.default_rng(0).dirichlet(np.full(layer.groups, 0.3))
    sizes = np.floor(shares * layer.m).astype(int)
  elif routing == "one_group":
    sizes = np.zeros(layer.groups, int)
    sizes[0] = layer.m
  else:
    raise ValueError(f"routing={routing!r} must be one of {ROUTINGS}")
  sizes[-1] += layer.m - sizes.sum()
  return sizes.astype(np.int32)


def _tokamax():
  try:
    import tokamax  # noqa: PLC0415 - an optional peer.
  except ImportError:
    return None
  return tokamax


def implementations(tokamax) -> dict:
  """name -> fn(lhs, rhs, group_sizes) for the grouped ones."""
  impls = dict(
      xla=lambda a, b, s: jax.lax.ragged_dot(a, b, s),
      ours=lambda a, b, s: ragged_dot(a, b, s),
  )
  if tokamax is not None:
    impls["tokamax"] = lambda a, b, s: tokamax.ragged_dot(a, b, s, implementation="mosaic")
  return impls


def ours_dense(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  """lhs (M, K) @ rhs (K, N) on `matmul` with `ragged_dot.default_config`'s
  config for that problem: the dense kernel on the grouped kernel's tiles."""
  config = default_config(operands.check_operands(lhs, rhs), lhs.dtype)
  return matmul(lhs, rhs, config=config)


def _group_bounds(sizes) -> tuple[int, ...]:
  """The rows [bounds[g], bounds[g + 1]) of each group, from sizes known on the host."""
  return tuple(int(b) for b in np.concatenate([[0], np.cumsum(np.asarray(sizes))]))


# The references multiply each group's rows alone, with the groups' rows as
# static slices: XLA's float32 `lax.ragged_dot` on the GPU builds a (G, M, K)
# temporary, 80 GB at deepseek-v2@4096 (160 experts), more than an H100 holds.
@functools.partial(jax.jit, static_argnames="bounds")
def _grouped_product(lhs, rhs, bounds):
  highest = jax.lax.Precision.HIGHEST
  parts = [jnp.dot(lhs[start:end], rhs[group], precision=highest)
           for group, (start, end) in enumerate(itertools.pairwise(bounds))]
  rows_past = jnp.zeros((lhs.shape[0] - bounds[-1], rhs.shape[2]), lhs.dtype)
  return jnp.concatenate([*parts, rows_past])


@functools.partial(jax.jit, static_argnames="bounds")
def _grouped_weight_gradient(lhs, g, bounds):
  highest = jax.lax.Precision.HIGHEST
  return jnp.stack([jnp.dot(lhs[start:end].T, g[start:end], precision=highest)
                    for start, end in itertools.pairwise(bounds)])


def forward_references(lhs: jax.Array, rhs: jax.Array, sizes) -> dict:
  """The float32 products the forward pass's errors are measured against:
  "grouped", the ragged product (M, N) of lhs (M, K), rhs (G, K, N) and
  sizes (G,) (host values: each group is multiplied alone); and "dense",
  lhs @ rhs[0], which `ours_dense` computes whatever the routing."""
  lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
  return dict(grouped=_grouped_product(lhs, rhs, _group_bounds(sizes)),
              dense=jnp.dot(lhs, rhs[0], precision=jax.lax.Precision.HIGHEST))


def weight_gradient_reference(lhs: jax.Array, g: jax.Array, sizes) -> jax.Array:
  """The float32 (G, K, N) weight gradient, each group's lhs_g.T @ g_g, from
  lhs (M, K), g (M, N) and sizes (G,) known on the host."""
  return _grouped_weight_gradient(lhs.astype(jnp.float32), g.astype(jnp.float32),
                                  _group_bounds(sizes))


def _xla_weight_gradient(lhs, g, sizes, groups):
  weights = jax.ShapeDtypeStruct((groups, lhs.shape[1], g.shape[1]), lhs.dtype)
  (d_rhs,) = jax.linear_transpose(lambda w: jax.lax.ragged_dot(lhs, w, sizes), weights)(g)
  return d_rhs


def _our_weight_gradient(lhs, g, sizes):
  return weight_gradient(lhs, g, sizes, lhs.dtype)


def _grads(fn, cotangent):
  # The output is returned too: unused, XLA would drop a linear forward.
  def step(a, b, s):
    out, vjp = jax.vjp(lambda x, w: fn(x, w, s), a, b)
    return out, *vjp(cotangent)
  return step


def bench_layer(layer: MoeLayer, routing: str, impls: list[str], passes: list[str],
                iterations: int) -> list[dict]:
  keys = jax.random.split(jax.random.key(1), 3)
  lhs = jax.random.normal(keys[0], (layer.m, layer.k), jnp.bfloat16)
  rhs = (jax.random.normal(keys[1], (layer.groups, layer.k, layer.n), jnp.float32)
         / np.sqrt(layer.k)).astype(jnp.bfloat16)
  cotangent = jax.random.normal(keys[2], (layer.m, layer.n), jnp.bfloat16)
  sizes = jnp.asarray(group_sizes(layer, routing))
  flops = 2 * layer.m * layer.k * layer.n
  want = forward_references(lhs, rhs, sizes)
  grouped = implementations(_tokamax())
  base = dict(layer=layer.name, family=layer.family, half=layer.half, routing=routing,
              m=layer.m, k=layer.k, n=layer.n,
              groups=layer.groups, group_sizes=[int(s) for s in sizes])
  records = []
  for pass_ in passes:
    times = {}
    errors = {}
    if pass_ == "weight_gradient":
      records += _bench_weight_gradient(layer, lhs, cotangent, sizes, impls, iterations, base)
      continue
    for impl in impls:
      args = (lhs, rhs, sizes)
      if impl == "dense":
        # One (K, N) weight, sliced outside the timed call.
        args, fn = (lhs, rhs[0], sizes), lambda a, b, s: jnp.dot(a, b)  # noqa: E731
      elif impl == "ours_dense":
        if pass_ != "forward":
          continue
        args, fn = (lhs, rhs[0], sizes), lambda a, b, s: ours_dense(a, b)  # noqa: E731
      elif impl == "jax_mgpu":
        if pass_ != "forward":
          continue
        fn, config = _best_jax_mgpu(lhs, rhs, sizes, iterations)
        if fn is None:
          continue
        base_config = config
      elif impl in grouped:
        fn = grouped[impl]
      else:
        continue  # A peer that does not import.
      step = fn if pass_ == "forward" else _grads(fn, cotangent)
      try:
        timing, out = time_gpu(impl, step, args, flops=flops * (1 if pass_ == "forward" else 3),
                               iterations=iterations)
      except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal.
        records.append(dict(base, impl=impl, **{"pass": pass_},
                            error=f"{type(e).__name__}: {e}"[:300]))
        continue
      times[impl] = timing
      if pass_ == "forward" and impl != "dense":
        reference = want["dense" if impl == "ours_dense" else "grouped"]
        errors[impl] = relative_error_on_device(out, reference)
      extra = dict(config=base_config) if impl == "jax_mgpu" else {}
      records.append(dict(base, impl=impl, **{"pass": pass_}, median_us=timing.median_us,
                          tflops=timing.tflops, rel_error=errors.get(impl), **extra))
    dense = times.get("dense")
    for r in records:
      if r.get("pass") == pass_ and dense is not None and "tflops" in r:
        r["ratio_to_dense"] = r["tflops"] / dense.tflops
  return records


def _bench_weight_gradient(layer: MoeLayer, lhs, g, sizes, impls: list[str], iterations: int,
                           base: dict) -> list[dict]:
  """The weight gradient alone: (G, K, N), each group's `lhs_g.T @ g_g`."""
  flops = 2 * layer.m * layer.k * layer.n
  want = weight_gradient_reference(lhs, g, sizes)
  fns = dict(dense=lambda a, b, s: jnp.dot(a.T, b),
             xla=functools.partial(_xla_weight_gradient, groups=layer.groups),
             ours=_our_weight_gradient)
  records, times = [], {}
  for impl in impls:
    extra = {}
    if impl == "jax_mgpu":
      from jax.experimental.pallas.ops.gpu import (  # noqa: PLC0415 - needs CUDA.
        transposed_ragged_dot_mgpu,
      )
      fn, extra["config"] = _best_jax_mgpu(lhs, g, sizes, iterations,
                                           transposed_ragged_dot_mgpu.transposed_ragged_dot)
      if fn is None:
        continue
    elif impl in fns:
      fn = fns[impl]
    else:
      continue  # tokamax's weight gradient runs only inside its vjp.
    record = dict(base, impl=impl, **{"pass": "weight_gradient"}, **extra)
    try:
      timing, out = time_gpu(impl, fn, (lhs, g, sizes), flops=flops, iterations=iterations)
    except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal.
      records.append(dict(record, error=f"{type(e).__name__}: {e}"[:300]))
      continue
    times[impl] = timing
    error = None if impl == "dense" else relative_error_on_device(out, want)
    records.append(dict(record, median_us=timing.median_us, tflops=timing.tflops,
                        rel_error=error))
  if "dense" in times:
    for r in records:
      if "tflops" in r:
        r["ratio_to_dense"] = r["tflops"] / times["dense"].tflops
  return records


def _best_jax_mgpu(lhs, rhs, sizes, iterations, kernel=None):
  """JAX's ragged_dot_mgpu (or `kernel`, one of its signature) at the fastest
  of `JAX_MGPU_SWEEP` that runs here."""
  if kernel is None:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: PLC0415 - needs CUDA.
    kernel = ragged_dot_mgpu.ragged_dot

  best = (None, None, float("inf"))
  for block_m, block_n, block_k, steps, grid_block_n in JAX_MGPU_SWEEP:
    fn = functools.partial(
        lambda a, b, s, **kw: kernel(a, b, group_sizes=s, **kw),
        block_m=block_m, block_n=block_n, block_k=block_k, max_concurrent_steps=steps,
        grid_block_n=grid_block_n)
    try:
      timing, _ = time_gpu("jax_mgpu", fn, (lhs, rhs, sizes), flops=1,
                           iterations=max(3, iterations // 4))
    except Exception:  # noqa: BLE001, S112 - a config that does not fit is skipped.
      continue
    if timing.median_us < best[2]:
      best = (fn, dict(block_m=block_m, block_n=block_n, block_k=block_k,
                       max_concurrent_steps=steps, grid_block_n=grid_block_n), timing.median_us)
  return best[0], best[1]


def layers_to_time(half: str, names: list[str] | None) -> list[str]:
  """The layers `names` if given, else those of `half` ("fit", "check" or
  "all"), in `LAYERS`' order."""
  if names:
    return list(names)
  return [layer.name for layer in LAYERS if half in ("all", layer.half)]


def summary(records: list[dict]) -> list[str]:
  """Each implementation's median ratio to dense, per pass."""
  lines = []
  for pass_, impl in itertools.product(PASSES, IMPLS):
    ratios = [r["ratio_to_dense"] for r in records
              if r.get("pass") == pass_ and r["impl"] == impl and "ratio_to_dense" in r]
    if ratios and impl != "dense":
      lines.append(f"median ratio to dense, {impl} {pass_}: {statistics.median(ratios):.3f} "
                   f"({len(ratios)} problems)")
  return lines


def main(argv):
  del argv
  by_name = {layer.name: layer for layer in LAYERS}
  layer_names = layers_to_time(_HALF.value, _LAYERS.value)
  for flag, values, known in ((_LAYERS, layer_names, sorted(by_name)),
                              (_ROUTINGS, _ROUTINGS.value, ROUTINGS), (_IMPLS, _IMPLS.value, IMPLS),
                              (_PASSES, _PASSES.value, PASSES)):
    unknown = [value for value in values if value not in known]
    if unknown:
      raise SystemExit(f"--{flag.name}: unknown {unknown}; known: {list(known)}")
  if not has_gpu():
    raise SystemExit("bench_ragged_dot needs a Hopper GPU; none is visible to JAX.")
  out_dir = cli.output_dir(_OUT_DIR.value)
  records = []
  path = os.path.join(out_dir, "ragged_dot_bench.json")
  for name, routing in itertools.product(layer_names, _ROUTINGS.value):
    records += bench_layer(by_name[name], routing, _IMPLS.value, _PASSES.value,
                           _ITERATIONS.value)
    report.write_json(path, records)  # After each layer, so a stopped run keeps its results.
  report.print_table(records, ["layer", "routing", "pass", "impl", "median_us", "tflops",
                               "ratio_to_dense", "rel_error", "error"])
  for line in summary(records):
    print(line)
  cli.say_written([path])


if __name__ == "__main__":
  cli.run(main)
