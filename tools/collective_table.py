"""The collective matmul table: one row per device count.

A row times, on random normal operands in the op's layout, for D devices and
one local problem (M_shard, K, N_shard):
  * the collective matmul (`collectives.all_gather_matmul`, or with
    `op="reduce_scatter"` `collectives.matmul_reduce_scatter`; it says which
    implementation it took), checked against a float32 XLA reference;
  * the baseline: `lax.all_gather` then one dot, or one dot then
    `lax.psum_scatter` (NCCL + cuBLAS on GPUs);
  * on GPUs, the lower bound: D times the single-GPU matmul of the local
    shard problem, plus `ROUND_LATENCY_US` per communication round;
and, on GPUs, each time as tensor-core utilization: the FLOPs of one device
(2 * D * M_shard * K * N_shard) over the device's peak rate times the time.

GPU times are CUPTI kernel times averaged over the devices (`core.timing`).
CUPTI sees the kernels of its own process only, so a call's CUPTI total is
divided by the devices of the ring this process drives (one in a job of one
process per GPU under `tools.launch`), not by the ring's size. A utilization
above 100% is refused: it means a time was divided by too many devices.
Rows of the XLA ring, whose transfers overlap its dots on other streams, are
timed by wall clock instead, baseline included (`WALL_CLOCK_IMPLEMENTATIONS`):
CUPTI's sum counts overlapped kernels twice. Wall clock is device time only
while dispatch keeps ahead of the GPUs, as it does with one process per GPU;
one process driving several GPUs dispatched this program more slowly (about
200 us a call on two H200s), so there both times can be dispatch's.
CPU times are wall-clock medians and only show that the path runs.

`measure_row` measures a row in this process. `measure_rows` on a host's GPUs
(`host_gpus` > 0) measures each row in a child process
(`tools/collective_table_child.py`) that sees only the row's GPUs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding

import collectives
from collectives import sharding
from core import device_facts, has_gpu, timing
from core.numerics import RELATIVE_TOLERANCE, relative_error_on_device
from pipelines import TuningConfig, matmul
from pipelines.operands import MatmulProblem
from tools import cli

# Latency of one NVLink send-and-signal round, for the lower bound.
ROUND_LATENCY_US = 6.0
COLUMNS = ("devices", "implementation", "kernel_us", "kernel_util", "lower_bound_us",
           "lower_bound_util", "baseline_us", "baseline_util", "speedup", "rel_error")
CPU_ITERATIONS = 5
# Implementations whose kernels overlap on several streams: on two H200s the
# sum of the XLA ring's kernel times was 503 us where a call took 170 us.
WALL_CLOCK_IMPLEMENTATIONS = frozenset({collectives.Implementation.XLA_RING.value})
# Calls issued back to back per wall-clock sample, so that dispatch overlaps
# the device work of the call before.
WALL_CLOCK_CALLS_PER_SAMPLE = 20
# The program that measures one row in a child process (`python -m`); see measure_rows.
CHILD_MODULE = "tools.collective_table_child"


@dataclasses.dataclass(frozen=True)
class _Op:
  """A collective matmul, its naive baseline, its sharding and its dispatcher's choice."""

  fn: Callable
  baseline: Callable
  layout: sharding.Layout
  choose: Callable


OPS = {
    "all_gather": _Op(collectives.all_gather_matmul, collectives.all_gather_then_matmul,
                      sharding.ALL_GATHER, collectives.choose_implementation),
    "reduce_scatter": _Op(collectives.matmul_reduce_scatter,
                          collectives.matmul_then_reduce_scatter, sharding.REDUCE_SCATTER,
                          collectives.choose_reduce_scatter_implementation),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalProblem:
  """One device's share of a ring of D devices.

  For `op="all_gather"` a device holds lhs (m_shard, k) and rhs (k, n_shard)
  and computes D blocks of (m_shard, n_shard); for `op="reduce_scatter"` it
  holds lhs (D * m_shard, k) and rhs (k, n_shard) (k is K_shard, n_shard all
  of N) and adds D partial blocks of (m_shard, n_shard) into its own. Either
  way a device does D local matmuls of (m_shard, k, n_shard).
  """

  m_shard: int
  k: int
  n_shard: int
  dtype: str = "float16"
  op: str = "all_gather"

  def __post_init__(self):
    if self.op not in OPS:
      raise ValueError(f"op={self.op!r} must be one of {sorted(OPS)}")

  def flops_per_device(self, num_devices: int) -> int:
    return 2 * num_devices * self.m_shard * self.k * self.n_shard

  def global_shapes(self, num_devices: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The global (lhs, rhs) shapes of the ring, in the op's layout."""
    d, m, k, n = num_devices, self.m_shard, self.k, self.n_shard
    if self.op == "all_gather":
      return (d * m, k), (k, d * n)
    return (d * m, d * k), (d * k, n)


def _float32_reference(mesh, layout: sharding.Layout):
  def ref(lhs, rhs):
    return jnp.dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST, out_sharding=NamedSharding(mesh, layout.out))
  return jax.jit(ref)


def measure_row(num_devices: int, problem: LocalProblem, *, config: TuningConfig | None = None,
                implementation: str = "auto", iterations: int = timing.DEFAULT_ITERATIONS
                ) -> dict:
  """Measures one row of the table on the first `num_devices` devices of the job."""
  mesh = sharding.ring_mesh(num_devices)
  d, p, op = num_devices, problem, OPS[problem.op]
  (m, k), (_, n) = p.global_shapes(d)
  lhs, rhs = cli.random_operands(m, k, n, p.dtype)
  args = sharding.place_operands(lhs, rhs, mesh, op.layout)
  kernel = sharding.ring_matmul_fn(op.fn, mesh, layout=op.layout, config=config,
                                   implementation=implementation)
  baseline = sharding.ring_matmul_fn(op.baseline, mesh, layout=op.layout)
  # The label is what the dispatcher runs for these shards, fallbacks included
  # (its problem: one device's shard, or for the reduce-scatter one row block).
  shard_problem = MatmulProblem(m=p.m_shard, k=p.k, n=p.n_shard, dtype=jnp.dtype(p.dtype))
  choice = op.choose(d, implementation, problem=shard_problem,
                     out_dtype=shard_problem.dtype, config=config)
  row = dict(op=p.op, devices=d, m_shard=p.m_shard, k=p.k, n_shard=p.n_shard, dtype=p.dtype,
             implementation=choice.implementation.value,
             config=repr(config) if config else "default")
  if has_gpu():
    gpu_row, out = _gpu_columns(row, p, mesh, kernel=kernel, baseline=baseline, args=args,
                                local_matmul=functools.partial(matmul, config=config),
                                iterations=iterations,
                                peak_flops=device_facts().dense_16bit_flops)
    row.update(gpu_row)
  else:
    kernel_t, out = timing.time_wall("kernel", kernel, args, flops=0, iterations=CPU_ITERATIONS)
    baseline_t, _ = timing.time_wall("baseline", baseline, args, flops=0,
                                     iterations=CPU_ITERATIONS)
    row.update(timer="wall clock (CPU)", kernel_us=kernel_t.median_us,
               baseline_us=baseline_t.median_us)
  row["speedup"] = row["baseline_us"] / row["kernel_us"]
  row["rel_error"] = relative_error_on_device(out, _float32_reference(mesh, op.layout)(*args))
  row["correct"] = row["rel_error"] <= RELATIVE_TOLERANCE[jnp.dtype(p.dtype)]
  return row


def local_device_count(mesh, process_index: int) -> int:
  """The devices of `mesh` that process `process_index` drives.

  These are the devices whose kernels that process's CUPTI reports: the
  divisor of a sharded call's CUPTI total (`timing.time_gpu(num_devices=)`).
  """
  count = sum(device.process_index == process_index for device in mesh.devices.flat)
  if count == 0:
    raise ValueError(f"process {process_index} drives none of the mesh's devices "
                     f"{list(mesh.devices.flat)}; it cannot time a call on them")
  return count


def _gpu_columns(row: dict, problem: LocalProblem, mesh, *, kernel, baseline, args,
                 local_matmul, iterations: int, peak_flops: float) -> tuple[dict, jax.Array]:
  """CUPTI times and utilizations of one row (see the module docstring).

  Returns the columns and the kernel's output (for checking).
  """
  d, p = row["devices"], problem
  flops = p.flops_per_device(d)
  local_devices = local_device_count(mesh, jax.process_index())
  if row["implementation"] in WALL_CLOCK_IMPLEMENTATIONS:
    timer = "wall clock"
    time_call = functools.partial(timing.time_wall, args=args, flops=flops,
                                  iterations=iterations,
                                  calls_per_sample=WALL_CLOCK_CALLS_PER_SAMPLE)
  else:
    timer = "cupti"
    time_call = functools.partial(timing.time_gpu, args=args, flops=flops,
                                  iterations=iterations, num_devices=local_devices)
  kernel_t, out = time_call("kernel", kernel)
  baseline_t, _ = time_call("baseline", baseline)
  local_args = cli.random_operands(p.m_shard, p.k, p.n_shard, p.dtype, seed=7)
  local_t, _ = timing.time_gpu("local matmul", local_matmul, local_args, flops=flops // d,
                               iterations=iterations)
  lower_us = d * local_t.median_us + ROUND_LATENCY_US * (d - 1)
  processes = len({device.process_index for device in mesh.devices.flat})
  columns = dict(timer=timer, processes=processes, local_devices=local_devices,
                 kernel_us=kernel_t.median_us, baseline_us=baseline_t.median_us,
                 local_matmul_us=local_t.median_us, lower_bound_us=lower_us)
  for name in ("kernel", "baseline", "lower_bound"):
    util = flops / peak_flops / (columns[f"{name}_us"] * 1e-6)
    if util > 1:
      raise ValueError(
          f"row devices={d} ({row['implementation']}, config {row['config']}, local problem "
          f"{p.m_shard}x{p.k}x{p.n_shard} {p.dtype}): {name}_util={util:.1%} exceeds 100% of "
          f"the peak {peak_flops:.3g} FLOP/s ({name}_us={columns[f'{name}_us']:.1f}, "
          f"{local_devices} local of {d} devices); no GPU runs that fast, so the time was "
          "divided by more devices than CUPTI timed")
    columns[f"{name}_util"] = util
  return columns, out


def measure_rows(device_counts, problem: LocalProblem, *, host_gpus: int,
                 config_text: str = "", implementation: str = "auto",
                 iterations: int = timing.DEFAULT_ITERATIONS) -> list[dict]:
  """One row per device count that can run.

  With `host_gpus` > 0 each row runs in its own process that sees only its D
  of the host's GPUs (the Mosaic kernel needs its ring to span every device
  of the job), so this process never touches a GPU. With 0 (CPU devices, or
  a job of several processes, where every process must take part) the rows
  run here, on the first D devices of the job.
  """
  config = cli.parse_config(TuningConfig, config_text) if config_text else None
  available = host_gpus or jax.device_count()
  rows = []
  for d in device_counts:
    if d > available:
      print(f"skipping {d} devices: there are {available}")
    elif host_gpus:
      rows.append(_measure_row_in_child(d, problem, config_text, implementation, iterations))
    else:
      rows.append(measure_row(d, problem, config=config, implementation=implementation,
                              iterations=iterations))
  return rows


def child_argv(num_devices: int, problem: LocalProblem, *, config_text: str,
               implementation: str, iterations: int, row_json: str) -> list[str]:
  """The command line of the child process that measures one row into `row_json`."""
  return [sys.executable, "-m", CHILD_MODULE, f"--devices={num_devices}",
          f"--m_shard={problem.m_shard}", f"--k={problem.k}", f"--n_shard={problem.n_shard}",
          f"--dtype={problem.dtype}", f"--op={problem.op}", f"--config={config_text}",
          f"--implementation={implementation}", f"--iterations={iterations}",
          f"--row_json={row_json}"]


def _measure_row_in_child(num_devices, problem, config_text, implementation, iterations) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "row.json")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, range(num_devices))))
    subprocess.run(child_argv(num_devices, problem, config_text=config_text,
                              implementation=implementation, iterations=iterations,
                              row_json=path),
                   env=env, check=True)
    with open(path) as f:
      return json.load(f)
