"""The cases every implementation of a collective matmul passes, written once.

`all_gather_matmul` and `matmul_reduce_scatter` each have several
implementations (the Mosaic ring kernel, the XLA ring, the naive XLA form);
each implementation's test is a short subclass of `CollectiveMatmulTestBase`
that names its function, its sharding layout and the shard shapes it can
tile. The global operands, the float32 reference, the tolerances, the
poisoning and the race check live here and in `core.testing`.
Test support only: no kernel module imports this.
"""

from __future__ import annotations

import functools
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import parameterized

import simulator
from collectives import sharding
from core import interpret, testing
from pipelines import matmul_reference

DTYPES = (jnp.float16, jnp.bfloat16)


class CollectiveMatmulTestBase(testing.KernelTestCase):
  """Cases for one implementation of a collective matmul.

  Attributes:
    layout: `sharding.ALL_GATHER` (per device lhs (M_shard, K), rhs
      (K, N_shard)) or `sharding.REDUCE_SCATTER` (lhs (M, K_shard), rhs
      (K_shard, N)).
    shard: for the all-gather (M_shard, K, N_shard); for the reduce-scatter
      (M / D rows of one output block, K_shard, N).
    device_counts: ring sizes to run (a case needing more devices than the
      job has skips, saying so).
  """

  layout = sharding.ALL_GATHER
  shard = (64, 128, 32)
  device_counts = (2, 4, 8)

  def implementation(self, lhs_shard, rhs_shard, axis_name, *, dtype=None):
    """The implementation under test, called inside `shard_map` over `axis_name`."""
    raise NotImplementedError

  def global_operands(self, seed: int, d: int, dtype):
    """Random normal global operands of a ring of `d` devices."""
    a, k, b = self.shard
    if self.layout == sharding.ALL_GATHER:
      shapes = (d * a, k), (k, d * b)
    else:
      shapes = (d * a, d * k), (d * k, b)
    return (testing.random_array(seed, shapes[0], dtype),
            testing.random_array(seed + 1, shapes[1], dtype))

  def run_ring(self, d: int, lhs, rhs, **kwargs):
    if d > jax.device_count():
      self.skipTest(f"needs {d} devices, the job has {jax.device_count()}")
    mesh = sharding.ring_mesh(d)
    run = sharding.ring_matmul_fn(self.implementation, mesh, layout=self.layout, **kwargs)
    return self.run_kernel(run, *sharding.place_operands(lhs, rhs, mesh, self.layout))

  def check(self, d: int, dtype, *, seed: int, out_dtype=None):
    lhs, rhs = self.global_operands(seed, d, dtype)
    out = self.run_ring(d, lhs, rhs, dtype=out_dtype)
    expected_shape = (lhs.shape[0], rhs.shape[1])
    self.assertEqual((out.shape, out.dtype), (expected_shape, jnp.dtype(out_dtype or dtype)))
    self.assert_close(out, matmul_reference(lhs, rhs), dtype=dtype)

  @parameterized.product(d_index=[0, 1, 2], dtype=DTYPES)
  def test_matches_reference(self, d_index, dtype):
    if d_index >= len(self.device_counts):
      self.skipTest(f"{type(self).__name__} runs rings of {self.device_counts} devices")
    self.check(self.device_counts[d_index], dtype, seed=20 + d_index)

  def test_output_dtype_other_than_the_operands(self):
    self.check(self.device_counts[0], jnp.bfloat16, seed=30, out_dtype=jnp.float16)


class OneDeviceRingTestCase(testing.KernelTestCase):
  """A ring kernel on a ring of one device: on GPUs only in a job of one GPU,
  since the ring's mesh axis must span the job (`topology.ring_axis_size`)."""

  def setUp(self):
    super().setUp()
    if self.backend == testing.GPU and jax.device_count() > 1:
      self.skipTest(f"a one-device ring needs a job of one GPU, this one has "
                    f"{jax.device_count()}: run with CUDA_VISIBLE_DEVICES=0")


class SimulatedRingTestCase(testing.KernelTestCase):
  """A Mosaic ring kernel's tests: simulated devices in the collective
  interpreter on CPU (`simulator`), every GPU of the host on GPUs."""

  min_gpus = 2
  # Bounds a wait on a signal that never comes (a broken kernel) in CI.
  wait_timeout_s = 60.0

  def setUp(self):
    super().setUp()
    if self.backend == testing.INTERPRET:
      self.enter_context(simulator.collective_interpret_mode(wait_timeout_s=self.wait_timeout_s))

  def simulated_devices(self, num_devices: int) -> None:
    """Skips, saying why, unless `num_devices` simulated devices can run here."""
    if self.backend != testing.INTERPRET:
      self.skipTest("simulated ring sizes run in interpret mode; the GPU run uses every GPU")
    if num_devices > jax.device_count():
      self.skipTest(f"needs {num_devices} simulated devices, the job has {jax.device_count()}")

  def spanning_ring(self, num_devices: int) -> None:
    """On GPUs the ring spans the job: other sizes skip, saying so."""
    if self.backend == testing.GPU and num_devices != jax.device_count():
      self.skipTest(f"the ring spans the job's {jax.device_count()} GPUs, not {num_devices}")

  def check_planted_race(self, module, name, replacement, run, args) -> None:
    """`run(*args)` with `module.name` replaced must be reported as a race."""
    # No warning: every TMA copy had its own pseudo-thread, so the detector
    # cannot have mistaken the broken send for a completed one.
    with mock.patch.object(module, name, replacement), \
        self.assertNoLogs(simulator.__name__, "WARNING"):
      jax.block_until_ready(run(*args))
    self.assertTrue(interpret.races_found(), f"{name} was broken and no race was reported")


def signals_before_landing(plgpu_module):
  """A planted bug for `check_planted_race`: `wait_smem_to_gmem` that waits
  only for reads, so a sender signals before its copies have landed (the
  kernels' only waits that are not read-only are the ones before a signal)."""
  return functools.partial(lambda original, n, wait_read_only=False:
                           original(n, wait_read_only=True) if wait_read_only else None,
                           plgpu_module.wait_smem_to_gmem)
