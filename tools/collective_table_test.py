"""The collective table's GPU arithmetic, on synthetic CUPTI timings (no GPU)."""

import dataclasses
import types
from unittest import mock

import jax
import numpy as np
from absl.testing import absltest, parameterized

from core import timing
from tools import collective_table, collective_table_child

# H200's dense 16-bit peak; the tests only need a fixed rate.
PEAK_FLOPS = 989.4e12
# The reference problem on 2 GPUs: 2 * 2 * 1024 * 4096 * 4096 FLOPs per device.
PROBLEM = collective_table.LocalProblem(m_shard=1024, k=4096, n_shard=4096)


def per_device_us(num_devices: int) -> dict[str, float]:
  """What one device spends on one call, in microseconds: about half the peak rate."""
  return {"kernel": 65.0 * num_devices, "baseline": 74.0 * num_devices, "local matmul": 60.0}


def fake_mesh(num_processes: int, devices_per_process: int):
  """A mesh's device layout: device i belongs to process i // devices_per_process."""
  devices = [types.SimpleNamespace(process_index=i // devices_per_process, id=i)
             for i in range(num_processes * devices_per_process)]
  return types.SimpleNamespace(devices=np.array(devices, dtype=object))


def cupti_time_gpu(local_devices: int, times_us: dict[str, float]):
  """`timing.time_gpu` with CUPTI's view of one process of the job.

  CUPTI reports the kernels of this process's devices only: a sharded call's
  total is one device's time per local device, which `time_gpu` divides by
  its `num_devices`. The local matmul runs on one device.
  """
  def time_gpu(name, fn, args, *, flops, iterations, num_devices=1):
    del fn, args, iterations
    devices = 1 if name == "local matmul" else local_devices
    total_us = times_us[name] * devices
    return timing.Timing(name=name, config="", compile_s=0.0,
                         times_us=(total_us / num_devices,), flops=flops), "output"
  return time_gpu


def wall_time(times_us: dict[str, float]):
  """`timing.time_wall` on a call that takes `times_us[name]` microseconds."""
  def time_wall(name, fn, args, *, flops, iterations, calls_per_sample):
    del fn, args, iterations, calls_per_sample
    return timing.Timing(name=name, config="", compile_s=0.0, times_us=(times_us[name],),
                         flops=flops), "output"
  return time_wall


def gpu_columns(num_processes: int, devices_per_process: int, times_us=None,
                implementation="mosaic", wall_times_us=None):
  mesh = fake_mesh(num_processes, devices_per_process)
  d = num_processes * devices_per_process
  times_us = times_us or per_device_us(d)
  row = dict(devices=d, implementation=implementation, config="default")
  with mock.patch.object(timing, "time_gpu", cupti_time_gpu(devices_per_process, times_us)), \
      mock.patch.object(timing, "time_wall", wall_time(wall_times_us or {})), \
      mock.patch.object(collective_table.jax, "process_index", return_value=0):
    return collective_table._gpu_columns(  # noqa: SLF001
        row, PROBLEM, mesh, kernel=None, baseline=None, args=(), local_matmul=None,
        iterations=1, peak_flops=PEAK_FLOPS)


class GpuColumnsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("one_process_per_gpu", 2, 1),
      ("one_process_for_both_gpus", 1, 2),
      ("two_processes_of_four", 2, 4),
  )
  def test_times_are_per_device(self, num_processes, devices_per_process):
    columns, out = gpu_columns(num_processes, devices_per_process)
    self.assertEqual(out, "output")
    self.assertEqual(columns["processes"], num_processes)
    self.assertEqual(columns["local_devices"], devices_per_process)
    d = num_processes * devices_per_process
    expected_us = per_device_us(d)
    self.assertAlmostEqual(columns["kernel_us"], expected_us["kernel"])
    self.assertAlmostEqual(columns["baseline_us"], expected_us["baseline"])
    self.assertAlmostEqual(columns["lower_bound_us"],
                           d * expected_us["local matmul"]
                           + collective_table.ROUND_LATENCY_US * (d - 1))
    flops = PROBLEM.flops_per_device(d)
    self.assertAlmostEqual(columns["baseline_util"],
                           flops / PEAK_FLOPS / (expected_us["baseline"] * 1e-6))

  def test_the_xla_ring_is_timed_by_wall_clock(self):
    # Its transfers overlap its dots on other streams, so CUPTI's sum of
    # kernel times (here 3x the call) would count the overlap twice.
    cupti_us = dict(per_device_us(2), kernel=510.0)
    columns, _ = gpu_columns(2, 1, times_us=cupti_us, implementation="xla_ring",
                             wall_times_us=dict(kernel=170.0, baseline=165.0))
    self.assertEqual(columns["timer"], "wall clock")
    self.assertAlmostEqual(columns["kernel_us"], 170.0)
    self.assertAlmostEqual(columns["baseline_us"], 165.0)
    # The lower bound is the local matmul's device time either way.
    self.assertAlmostEqual(columns["local_matmul_us"], cupti_us["local matmul"])
    columns, _ = gpu_columns(2, 1, implementation="mosaic")
    self.assertEqual(columns["timer"], "cupti")

  def test_the_reported_two_gpu_baseline(self):
    # Dividing by the job's 2 devices printed 74 us and 93% of the peak.
    columns, _ = gpu_columns(2, 1)
    self.assertAlmostEqual(columns["baseline_us"], 148.0)
    self.assertAlmostEqual(columns["baseline_util"], 0.469, places=3)

  def test_utilization_above_100_percent_is_refused(self):
    with self.assertRaisesRegex(
        ValueError, r"row devices=2 \(mosaic, config default.*\): baseline_util=115\.8% "
        r"exceeds 100%.*baseline_us=60\.0"):
      gpu_columns(2, 1, times_us=dict(per_device_us(2), baseline=60.0))

  def test_local_device_count(self):
    self.assertEqual(collective_table.local_device_count(fake_mesh(4, 2), 3), 2)
    with self.assertRaisesRegex(ValueError, "process 4 drives none of the mesh's devices"):
      collective_table.local_device_count(fake_mesh(4, 2), 4)


class ChildCommandLineTest(absltest.TestCase):

  def test_child_parses_what_the_table_writes(self):
    argv = collective_table.child_argv(4, PROBLEM, config_text="tile_m=64,tile_n=256",
                                       implementation="xla_ring", iterations=7,
                                       row_json="/tmp/row.json")
    self.assertEqual(argv[1:3], ["-m", collective_table.CHILD_MODULE])
    self.assertEqual(collective_table_child.__name__, collective_table.CHILD_MODULE)
    a = collective_table_child.parse_args(argv[3:])
    self.assertEqual((a.devices, a.m_shard, a.k, a.n_shard, a.dtype),
                     (4, PROBLEM.m_shard, PROBLEM.k, PROBLEM.n_shard, PROBLEM.dtype))
    self.assertEqual((a.config, a.implementation, a.iterations, a.row_json),
                     ("tile_m=64,tile_n=256", "xla_ring", 7, "/tmp/row.json"))
    rs_problem = dataclasses.replace(PROBLEM, op="reduce_scatter")
    argv = collective_table.child_argv(2, rs_problem, config_text="", implementation="auto",
                                       iterations=1, row_json="/tmp/row.json")
    self.assertEqual(collective_table_child.parse_args(argv[3:]).op, "reduce_scatter")

  def test_unknown_op_is_refused(self):
    with self.assertRaisesRegex(ValueError, r"op='all_reduce' must be one of"):
      collective_table.LocalProblem(m_shard=8, k=16, n_shard=8, op="all_reduce")


class CpuRowTest(absltest.TestCase):
  """A row of each op on simulated CPU devices: the op's layout, label and reference."""

  def test_rows_of_both_ops(self):
    if jax.default_backend() != "cpu":
      self.skipTest("checks the CPU rows; on GPUs the dispatcher takes GPU paths")
    if jax.device_count() < 2:
      self.skipTest("needs 2 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8")
    for op, shapes in (("all_gather", ((64, 64), (64, 64))),
                       ("reduce_scatter", ((64, 128), (128, 32)))):
      with self.subTest(op=op):
        problem = collective_table.LocalProblem(m_shard=32, k=64, n_shard=32, op=op)
        self.assertEqual(problem.global_shapes(2), shapes)
        with mock.patch.object(collective_table, "has_gpu", return_value=False):
          row = collective_table.measure_row(2, problem)
        self.assertEqual((row["op"], row["implementation"]), (op, "xla_ring"))
        self.assertTrue(row["correct"], row)


if __name__ == "__main__":
  absltest.main()
