"""One training step of a tensor-parallel MLP block on our kernels, checked against the
same model in plain XLA collectives.

    bazel run //examples:tp_mlp
    bazel run //examples:tp_mlp -- --device_counts=2,8 --seq_shard=64 --implementation=xla_ring
    bazel run //examples:tp_mlp -- --block=gelu

Activations are sequence parallel (x: (S, H), rows sharded over the D devices
of a 1-D mesh) and the weights Megatron-style (the up projection by columns,
the down projection w2: (F, H) by rows). Two blocks (`--block`):

  gated (the default; Llama's and Qwen's MLP), with the up projection's gate
  and up weights stored fused, each device holding [w_gate shard | w_up shard]
  as w13: (H, 2 F / D):

    h = silu(x @ w_gate) * (x @ w_up)           # (S, F / D) per device
    y = matmul_reduce_scatter(h, w2) + x         # (S / D, H) per device

  where on one device (nothing to gather) h is `pipelines.gated_linear_unit(x,
  w13)`, one kernel for both products and the gate; on more, the gated kernel
  has no ring form, so `all_gather_matmul(x, w13)` gathers x once for both
  products and the gate is an XLA fusion.

  gelu (GPT-style), with w1: (H, F) and b1 split by columns:

    h = gelu(all_gather_matmul(x, w1) + b1)     # (S, F / D) per device
    y = matmul_reduce_scatter(h, w2) + x         # (S / D, H) per device

One step: forward, loss = mean((y - target)^2), backward (the kernels' custom
VJPs), SGD update, on random data. The same model written with
`lax.all_gather`, `jnp.dot` and `lax.psum_scatter` (XLA's autodiff) takes the
same step from the same parameters; the loss, every parameter's gradient and
every updated parameter must agree within `tolerance(dtype)` (errors are
printed), and both step times are printed side by side: GPU time (CUPTI, the
mean over the process's devices) on GPUs, wall clock on CPU, where it only
shows that it runs. The exit status is non-zero if anything disagrees.

With no GPU it runs on simulated CPU devices (8 unless XLA_FLAGS says
otherwise), at small default shapes, where "auto" takes the XLA rings. On
GPUs (and under `tools.launch`, one row over every device of the job) the
same shard_map code runs the Mosaic ring kernels where they can run.
"""

from __future__ import annotations

import os

# Simulated CPU devices must be requested before JAX starts; the flag has no
# effect on GPUs.
SIMULATED_CPU_DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={SIMULATED_CPU_DEVICES}").strip()

import dataclasses  # noqa: E402 - after the XLA_FLAGS set-up above.
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import collectives  # noqa: E402
import pipelines  # noqa: E402
from collectives import sharding  # noqa: E402
from core import timing  # noqa: E402
from core.numerics import RELATIVE_TOLERANCE, relative_error_on_device  # noqa: E402
from pipelines.operands import MatmulProblem  # noqa: E402
from tools import cli, launch  # noqa: E402

AXIS = sharding.RING_AXIS
X_SPEC, W1_SPEC, B1_SPEC, W2_SPEC = P(AXIS, None), P(None, AXIS), P(AXIS), P(AXIS, None)
BLOCKS = ("gated", "gelu")
# Each block's parameters, and how they are sharded (w13 by columns, like w1).
PARAM_NAMES = {"gated": ("w13", "w2"), "gelu": ("w1", "b1", "w2")}
PARAM_SPECS = {"gated": (W1_SPEC, W2_SPEC), "gelu": (W1_SPEC, B1_SPEC, W2_SPEC)}
# --implementation: the same name for both collective matmuls, except "naive",
# which is each one's NCCL form.
IMPLEMENTATIONS = {
    "auto": ("auto", "auto"), "mosaic": ("mosaic", "mosaic"), "local": ("local", "local"),
    "xla_ring": ("xla_ring", "xla_ring"), "naive": ("xla_all_gather", "xla_reduce_scatter"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
  """Per device: seq_shard rows of x, ffn_shard columns of w1 (rows of w2); hidden is H."""

  seq_shard: int
  hidden: int
  ffn_shard: int


GPU_SHAPE = Shape(seq_shard=1024, hidden=4096, ffn_shard=2048)
CPU_SHAPE = Shape(seq_shard=32, hidden=128, ffn_shard=64)


def tolerance(dtype) -> float:
  """Relative error allowed between the two models' results: each rounds to `dtype`
  at the same points but in another order, so twice one kernel's tolerance."""
  return 2 * RELATIVE_TOLERANCE[jnp.dtype(dtype)]


def _split_gate_up(h, dtype):
  """silu(gate) * up of a (rows, 2 F_shard) float32 product [gate | up], in `dtype`."""
  gate, up = jnp.split(h, 2, axis=-1)
  return (jax.nn.silu(gate) * up).astype(dtype)


def gated_kernel_runs_up_projection(num_devices: int, implementation: str) -> bool:
  """Whether the gated block's up projection is the fused gated kernel: on one
  device (nothing to gather) unless `implementation` asks for a ring."""
  return num_devices == 1 and IMPLEMENTATIONS[implementation][0] in ("auto", "local")


def collective_gated_block(x, w13, w2, *, implementation: str):
  all_gather_impl, reduce_scatter_impl = IMPLEMENTATIONS[implementation]
  if gated_kernel_runs_up_projection(lax.axis_size(AXIS), implementation):
    # The fused gated kernel reads each x tile once for both products and
    # writes h alone.
    # [gate | up] columns are the (K, 2, N) fused weight, reshaped in place.
    h = pipelines.gated_linear_unit(x, w13.reshape(w13.shape[0], 2, -1), activation="silu")
  else:
    h = collectives.all_gather_matmul(x, w13, AXIS, implementation=all_gather_impl)
    h = _split_gate_up(h.astype(jnp.float32), x.dtype)
  y = collectives.matmul_reduce_scatter(h, w2, AXIS, implementation=reduce_scatter_impl)
  return y.astype(jnp.float32) + x.astype(jnp.float32)


# The XLA blocks compute what the collective ones do, as a user writes them:
# each product in the operand dtype (so their backward products take
# cotangents of that dtype, as ours do), the elementwise work and the
# reduce-scatter's sums in float32.
def xla_gated_block(x, w13, w2):
  gathered = lax.all_gather(x, AXIS, axis=0, tiled=True)
  h = _split_gate_up(jnp.dot(gathered, w13).astype(jnp.float32), x.dtype)
  partial = jnp.dot(h, w2).astype(jnp.float32)
  y = lax.psum_scatter(partial, AXIS, scatter_dimension=0, tiled=True)
  return y + x.astype(jnp.float32)


def collective_gelu_block(x, w1, b1, w2, *, implementation: str):
  all_gather_impl, reduce_scatter_impl = IMPLEMENTATIONS[implementation]
  h = collectives.all_gather_matmul(x, w1, AXIS, implementation=all_gather_impl)
  h = jax.nn.gelu(h.astype(jnp.float32) + b1).astype(x.dtype)
  y = collectives.matmul_reduce_scatter(h, w2, AXIS, implementation=reduce_scatter_impl)
  return y.astype(jnp.float32) + x.astype(jnp.float32)


def xla_gelu_block(x, w1, b1, w2):
  gathered = lax.all_gather(x, AXIS, axis=0, tiled=True)
  h = jnp.dot(gathered, w1).astype(jnp.float32)
  h = jax.nn.gelu(h + b1).astype(x.dtype)
  partial = jnp.dot(h, w2).astype(jnp.float32)
  y = lax.psum_scatter(partial, AXIS, scatter_dimension=0, tiled=True)
  return y + x.astype(jnp.float32)


COLLECTIVE_BLOCKS = {"gated": collective_gated_block, "gelu": collective_gelu_block}
XLA_BLOCKS = {"gated": xla_gated_block, "gelu": xla_gelu_block}


def make_train_step(block, param_specs, mesh, learning_rate: float):
  """Jitted (params, x, target) -> (loss, grads, updated params) of `block` under shard_map."""
  forward = jax.shard_map(block, mesh=mesh, in_specs=(X_SPEC, *param_specs), out_specs=X_SPEC)

  def loss_fn(params, x, target):
    return jnp.mean((forward(x, *params) - target) ** 2)

  @jax.jit
  def step(params, x, target):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
    updated = jax.tree.map(
        lambda p, g: (p.astype(jnp.float32) - learning_rate * g.astype(jnp.float32)
                      ).astype(p.dtype), params, grads)
    return loss, grads, updated

  return step


def _place(x, spec, mesh):
  """A host array every process holds in full, placed by `spec` (each process its shards)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def random_problem(block: str, num_devices: int, shape: Shape, dtype, mesh, seed: int = 0):
  """(params, x, target) for `block`, random normal, placed on `mesh`."""
  s, h, f = num_devices * shape.seq_shard, shape.hidden, num_devices * shape.ffn_shard
  keys = jax.random.split(jax.random.key(seed), 5)
  normal = lambda key, dims, scale: scale * jax.random.normal(key, dims, jnp.float32)  # noqa: E731
  w2 = normal(keys[2], (f, h), f ** -0.5).astype(dtype)
  x = normal(keys[3], (s, h), 1.0).astype(dtype)
  target = normal(keys[4], (s, h), 1.0)
  if block == "gated":
    # Global (H, 2 F): device j's columns are [w_gate shard j | w_up shard j].
    params = (normal(keys[0], (h, 2 * f), h ** -0.5).astype(dtype), w2)
  else:
    params = (normal(keys[0], (h, f), h ** -0.5).astype(dtype), normal(keys[1], (f,), 0.1), w2)
  params = tuple(_place(p, spec, mesh) for p, spec in zip(params, PARAM_SPECS[block],
                                                          strict=True))
  return params, _place(x, X_SPEC, mesh), _place(target, X_SPEC, mesh)


def implementation_labels(block: str, num_devices: int, shape: Shape, dtype,
                          implementation: str) -> str:
  """What the up projection and the reduce-scatter matmul of the forward pass run."""
  all_gather_impl, reduce_scatter_impl = IMPLEMENTATIONS[implementation]
  dtype = jnp.dtype(dtype)
  up_columns = 2 * shape.ffn_shard if block == "gated" else shape.ffn_shard
  if block == "gated" and gated_kernel_runs_up_projection(num_devices, implementation):
    up = "gated_linear_unit"
  else:
    up = collectives.choose_implementation(
        num_devices, all_gather_impl, out_dtype=dtype,
        problem=MatmulProblem(m=shape.seq_shard, k=shape.hidden, n=up_columns,
                              dtype=dtype)).implementation.value
  reduce_scatter = collectives.choose_reduce_scatter_implementation(
      num_devices, reduce_scatter_impl, out_dtype=dtype,
      problem=MatmulProblem(m=shape.seq_shard, k=shape.ffn_shard, n=shape.hidden, dtype=dtype))
  return f"{up} / {reduce_scatter.implementation.value}"


def on_gpus(mesh) -> bool:
  return mesh.devices.flat[0].platform == "gpu"


def time_step(name: str, step, args, mesh, iterations: int):
  """(timing, output) of `step(*args)`: CUPTI on GPUs, the mean over this process's devices of
  the mesh; wall clock elsewhere, one blocking call per sample."""
  if not on_gpus(mesh):
    return timing.time_wall(name, step, args, flops=0, iterations=iterations)
  local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  return timing.time_gpu(name, step, args, flops=0, iterations=iterations, num_devices=local)


def run_row(num_devices: int, shape: Shape, *, block: str = "gated", dtype=jnp.bfloat16,
            implementation: str = "auto", learning_rate: float = 0.1,
            iterations: int = 20) -> dict:
  """One training step of both models of `block` on the first `num_devices` devices; their
  agreement and step times."""
  mesh = sharding.ring_mesh(num_devices)
  params, x, target = random_problem(block, num_devices, shape, dtype, mesh)
  collective_block = COLLECTIVE_BLOCKS[block]
  ours = make_train_step(lambda *a: collective_block(*a, implementation=implementation),
                         PARAM_SPECS[block], mesh, learning_rate)
  xla = make_train_step(XLA_BLOCKS[block], PARAM_SPECS[block], mesh, learning_rate)
  ours_t, (loss, grads, updated) = time_step("ours", ours, (params, x, target), mesh, iterations)
  xla_t, (xla_loss, xla_grads, xla_updated) = time_step("xla", xla, (params, x, target), mesh,
                                                        iterations)
  ours_ms, xla_ms = ours_t.median_us / 1e3, xla_t.median_us / 1e3
  errors = {"loss": abs(float(loss) - float(xla_loss)) / abs(float(xla_loss))}
  for name, got, want in zip(PARAM_NAMES[block], grads, xla_grads, strict=True):
    errors[f"d {name}"] = relative_error_on_device(got, want)
  for name, got, want in zip(PARAM_NAMES[block], updated, xla_updated, strict=True):
    errors[f"new {name}"] = relative_error_on_device(got, want)
  tol = tolerance(dtype)
  return dict(devices=num_devices, block=block, implementation=implementation_labels(
                  block, num_devices, shape, dtype, implementation),
              loss=float(loss), step_ms=ours_ms, xla_step_ms=xla_ms,
              gpu_time=on_gpus(mesh), errors=errors,
              tolerance=tol, agree=all(e <= tol for e in errors.values()))


_DEVICE_COUNTS = flags.DEFINE_list("device_counts", None,
                                   "Mesh sizes; default: every GPU of the host, or 8 CPU devices.")
_SEQ_SHARD = flags.DEFINE_integer("seq_shard", None, "Sequence rows per device (S / D).",
                                  lower_bound=1)
_HIDDEN = flags.DEFINE_integer("hidden", None, "Model width H.", lower_bound=1)
_FFN_SHARD = flags.DEFINE_integer("ffn_shard", None, "MLP width per device (F / D).", lower_bound=1)
_BLOCK = flags.DEFINE_enum("block", "gated", list(BLOCKS),
                           "The MLP: gated (silu gate, fused gate/up weight) or gelu (with bias).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float16", "bfloat16"],
                           "Dtype of weights and activations.")
_IMPLEMENTATION = flags.DEFINE_enum("implementation", "auto", list(IMPLEMENTATIONS),
                                    "Implementation of both collective matmuls; 'naive' is "
                                    "lax.all_gather + dot and dot + lax.psum_scatter.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 0.1, "SGD step size.")
_ITERATIONS = flags.DEFINE_integer("iterations", 20, "Timed steps per model.", lower_bound=1)


def main(argv):
  del argv
  launched = launch.initialize()
  gpus = launch.gpu_count()
  on_gpu = gpus > 0 and os.environ.get("JAX_PLATFORMS") != "cpu"
  default = GPU_SHAPE if on_gpu else CPU_SHAPE
  shape = Shape(seq_shard=_SEQ_SHARD.value or default.seq_shard,
                hidden=_HIDDEN.value or default.hidden,
                ffn_shard=_FFN_SHARD.value or default.ffn_shard)
  if launched:
    counts = [jax.device_count()]
  elif _DEVICE_COUNTS.value:
    counts = [int(c) for c in _DEVICE_COUNTS.value]
  else:
    counts = [gpus if on_gpu else SIMULATED_CPU_DEVICES]
  print(f"{gpus} GPU(s) on this host: collective matmuls as the dispatchers choose" if on_gpu else
        "no GPU: simulated CPU devices; step times are CPU wall clock and only show that it runs")
  up = (f"w13 ({shape.hidden}, 2 x {shape.ffn_shard}) [gate | up]" if _BLOCK.value == "gated"
        else f"w1 ({shape.hidden}, {shape.ffn_shard}) and b1")
  print(f"{_BLOCK.value} block, per device: x ({shape.seq_shard}, {shape.hidden}), {up}, "
        f"w2 ({shape.ffn_shard}, {shape.hidden}) {_DTYPE.value}; one SGD step, learning rate "
        f"{_LEARNING_RATE.value}")
  ok = True
  for d in counts:
    row = run_row(d, shape, block=_BLOCK.value, dtype=jnp.dtype(_DTYPE.value),
                  implementation=_IMPLEMENTATION.value, learning_rate=_LEARNING_RATE.value,
                  iterations=_ITERATIONS.value)
    print(f"\n{d} devices, up projection / matmul_reduce_scatter: {row['implementation']}")
    clock = "GPU time (CUPTI)" if row["gpu_time"] else "wall clock"
    print(f"  step time ({clock}, median of {_ITERATIONS.value}): ours {row['step_ms']:.3f} ms, "
          f"XLA all_gather/dot/psum_scatter {row['xla_step_ms']:.3f} ms "
          f"({row['xla_step_ms'] / row['step_ms']:.2f}x)")
    print(f"  loss {row['loss']:.5f}; relative errors against the XLA model "
          f"(tolerance {row['tolerance']:.0e}):")
    for name, err in row["errors"].items():
      print(f"    {name:6s} {err:.2e}{'' if err <= row['tolerance'] else '  TOO LARGE'}")
    ok &= row["agree"]
  if not ok:
    print("FAILED: the collective-matmul model disagrees with the XLA model")
    sys.exit(1)
  print("\ntp_mlp: gradients and updated weights match the XLA model")


if __name__ == "__main__":
  cli.run(main)
