"""Tests of multi-device GPU interpret mode: semaphores, peer refs, races across devices.

Small hand-written kernels under `jax.shard_map` on simulated CPU devices
(Bazel sets XLA_FLAGS=--xla_force_host_platform_device_count=8).
"""

import threading
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import lax
from jax._src.pallas.mosaic.interpret import thread_map
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import simulator
from core import interpret, testing
from simulator import thread_pool

# XLA sizes its CPU thread pool when jax starts the CPU backend, which no
# import above does: size it for the up to 24 waiting simulated threads below.
simulator.reserve_intra_op_threads()

AXIS = "x"
ROWS, COLS = 16, 128  # One device's shard of a test input.


def _mesh(num_devices: int) -> jax.sharding.Mesh:
  return jax.make_mesh((num_devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))


def _sharded_input(seed: int, mesh, rows: int = ROWS) -> jax.Array:
  x = testing.random_array(seed, (mesh.size * rows, COLS), jnp.float32)
  return jax.device_put(x, NamedSharding(mesh, P(AXIS)))


def _run(kernel_fn, mesh, x, num_outputs: int):
  fn = jax.shard_map(kernel_fn, mesh=mesh, in_specs=P(AXIS),
                     out_specs=(P(AXIS),) * num_outputs, check_vma=False)
  return jax.block_until_ready(jax.jit(fn)(x))


def _neighbour_shards(x: np.ndarray, num_devices: int, offset: int) -> np.ndarray:
  """Device d's shard replaced by device (d + offset) % D's."""
  shards = x.reshape(num_devices, -1, x.shape[-1])
  return np.roll(shards, -offset, axis=0).reshape(x.shape)


def _ring_shift(num_devices: int, *, wait_before_read: bool = True,
                signal_after_copy: bool = True):
  """Each device sends its shard through SMEM into `scratch` of device d-1 and
  copies what it received from d+1 to `out`.

  The flags plant the two classic bugs: reading the slot before the signal
  says it is complete, and signalling before the TMA store is complete.
  """

  def body(x_gmem, out_gmem, scratch_gmem):
    received = pl.get_global(plgpu.SemaphoreType.REGULAR)
    dev = lax.axis_index(AXIS)
    left = lax.rem(dev + num_devices - 1, num_devices)

    def scoped(send_smem, recv_smem, load_barrier, recv_barrier):
      plgpu.copy_gmem_to_smem(x_gmem, send_smem, load_barrier)
      plgpu.barrier_wait(load_barrier)
      plgpu.copy_smem_to_gmem(send_smem, plgpu.remote_ref(scratch_gmem, left))
      if signal_after_copy:
        # The store must be complete (not just its SMEM read) before the
        # receiver may read the slot.
        plgpu.wait_smem_to_gmem(0)
        pl.semaphore_signal(received, device_id=left)
      else:
        pl.semaphore_signal(received, device_id=left)
        plgpu.wait_smem_to_gmem(0)
      if wait_before_read:
        pl.semaphore_wait(received, 1)  # Our slot now holds device d+1's shard.
      plgpu.copy_gmem_to_smem(scratch_gmem, recv_smem, recv_barrier)
      plgpu.barrier_wait(recv_barrier)
      if not wait_before_read:
        pl.semaphore_wait(received, 1)
      plgpu.copy_smem_to_gmem(recv_smem, out_gmem)
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, plgpu.SMEM((ROWS, COLS), jnp.float32),
                  plgpu.SMEM((ROWS, COLS), jnp.float32), plgpu.Barrier(), plgpu.Barrier())

  shape = jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32)
  return plgpu.kernel(body, out_type=(shape, shape), kernel_name="ring_shift",
                      interpret=interpret.interpret_params())


def _slot_reuse(num_devices: int, *, guarded: bool):
  """Two rounds of a ring shift through one scratch slot, one semaphore per round.

  Before round 1 overwrites device d-1's slot, the sender must know that d-1
  has read round 0 from it: d-1 signals `free` back (a decrementing wait).
  Without that, the overwrite races d-1's read in every interleaving, since
  nothing d-1 does after its read reaches the sender before the overwrite.
  """
  round_sems, free = (0, 1), 2  # Indices into the semaphore array.

  def body(x_gmem, out_gmem, scratch_gmem):
    sems = pl.get_global(plgpu.SemaphoreType.REGULAR((3,)))
    dev = lax.axis_index(AXIS)
    left = lax.rem(dev + num_devices - 1, num_devices)
    right = lax.rem(dev + 1, num_devices)

    def scoped(send_smem, recv_smem, load_barrier, recv_barriers):
      plgpu.copy_gmem_to_smem(x_gmem, send_smem, load_barrier)
      plgpu.barrier_wait(load_barrier)

      def send(round_):
        plgpu.copy_smem_to_gmem(send_smem, plgpu.remote_ref(scratch_gmem, left))
        plgpu.wait_smem_to_gmem(0)
        pl.semaphore_signal(sems.at[round_sems[round_]], device_id=left)

      def receive(round_):
        pl.semaphore_wait(sems.at[round_sems[round_]], 1)
        plgpu.copy_gmem_to_smem(scratch_gmem, recv_smem, recv_barriers.at[round_])
        plgpu.barrier_wait(recv_barriers.at[round_])

      send(0)
      if guarded:
        receive(0)
        pl.semaphore_signal(sems.at[free], device_id=right)  # d+1 may overwrite our slot.
        pl.semaphore_wait(sems.at[free], 1)  # d-1 has read round 0 from its slot.
        send(1)
      else:
        send(1)
        receive(0)
      receive(1)
      plgpu.copy_smem_to_gmem(recv_smem, out_gmem)
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, plgpu.SMEM((ROWS, COLS), jnp.float32),
                  plgpu.SMEM((ROWS, COLS), jnp.float32), plgpu.Barrier(),
                  plgpu.Barrier(num_barriers=2))

  shape = jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32)
  return plgpu.kernel(body, out_type=(shape, shape), kernel_name="slot_reuse",
                      interpret=interpret.interpret_params())


def _all_gather(num_devices: int, num_blocks: int):
  """A multi-step ring all-gather; each block forwards its rows every step.

  Step s sends what arrived at step s-1 (at step 0 the local shard) into slot
  s of device d-1's scratch and signals `received` there once per block; every
  block then waits, without decrementing, until the count says that all
  blocks of device d+1 sent step s.

  A count of (s+1) * num_blocks alone does not say that: a fast block of d+1
  could send step s+1 before a slow one sent step s (the interpreter reports
  that race when a CPU core is busy). So no block sends step s before every
  block of its own device sent step s-1, which the local `sent` count tells.
  """
  rows = ROWS // num_blocks

  def body(x_gmem, out_gmem, scratch_gmem):
    received = pl.get_global(plgpu.SemaphoreType.REGULAR)
    sent = pl.get_global(plgpu.SemaphoreType.REGULAR)
    dev = lax.axis_index(AXIS)
    block = lax.axis_index("block")
    left = lax.rem(dev + num_devices - 1, num_devices)
    block_rows = pl.ds(block * rows, rows)

    def scoped(smem, barrier):
      def step(s, source_gmem):
        plgpu.copy_gmem_to_smem(source_gmem, smem, barrier)
        plgpu.barrier_wait(barrier)
        owner = lax.rem(dev + s, num_devices)  # Whose shard `smem` holds.
        plgpu.copy_smem_to_gmem(smem, out_gmem.at[pl.ds(owner * ROWS + block * rows, rows)])
        @pl.when(s < num_devices - 1)
        def _send():
          pl.semaphore_wait(sent, s * num_blocks, decrement=False)
          plgpu.copy_smem_to_gmem(smem, plgpu.remote_ref(scratch_gmem, left).at[s, block_rows])
          plgpu.wait_smem_to_gmem(0)  # Both stores done: `smem` is free, slot s is written.
          pl.semaphore_signal(received, device_id=left)
          pl.semaphore_signal(sent)  # On this device.
          # Counts only grow: after step s every block of d+1 signalled s+1 times.
          pl.semaphore_wait(received, (s + 1) * num_blocks, decrement=False)
        plgpu.wait_smem_to_gmem(0)

      step(0, x_gmem.at[block_rows])

      @pl.loop(1, num_devices)
      def _(s):
        step(s, scratch_gmem.at[s - 1, block_rows])

    pl.run_scoped(scoped, plgpu.SMEM((rows, COLS), jnp.float32), plgpu.Barrier())

  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((num_devices * ROWS, COLS), jnp.float32),
                jax.ShapeDtypeStruct((num_devices - 1, ROWS, COLS), jnp.float32)),
      grid=(num_blocks,), grid_names=("block",), kernel_name="ring_all_gather",
      interpret=interpret.interpret_params())


def _per_slot_waits(num_devices: int, num_blocks: int, num_threads: int = 3):
  """The ring matmul's pattern: a semaphore per slot, signalled and waited in `pl.loop`.

  At step s warpgroup 0 of every block signals slot s of device d-1, then
  every warpgroup waits until slot s of its own device counts every block of
  d+1. Before the wait each thread does tile work that XLA spreads over its
  intra-op pool, whose threads then run the waits; with more simulated threads
  than pool threads (4 x 2 x 3 = 24 against one per CPU device by default),
  the waiters held every pool thread and the kernel deadlocked.
  """

  def body(x_gmem, out_gmem):
    received = pl.get_global(plgpu.SemaphoreType.REGULAR((num_devices - 1,)))
    dev = lax.axis_index(AXIS)
    left = lax.rem(dev + num_devices - 1, num_devices)
    wg = lax.axis_index("wg")

    @pl.loop(0, num_devices)
    def _(step):
      x = x_gmem[...]
      # Independent matmuls (not fused, buffers above XLA's sequential threshold).
      work = sum(jnp.sum(jnp.dot(x * (i + 1), x.T)) for i in range(12))
      never = (work < -1e30).astype(jnp.int32)  # 0, but only known at run time.
      sends = step < num_devices - 1

      @pl.when((wg == 0) & sends)
      def _signal():
        pl.semaphore_signal(received.at[step], device_id=left)

      @pl.when(sends)
      def _wait():
        pl.semaphore_wait(received.at[step], num_blocks + never, decrement=False)

    @pl.when((lax.axis_index("block") == 0) & (wg == 0))
    def _():
      out_gmem[...] = x_gmem[...]

  return plgpu.kernel(
      body, out_type=(jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),),
      grid=(num_blocks,), grid_names=("block",), num_threads=num_threads, thread_name="wg",
      interpret=interpret.interpret_params())


class CollectiveInterpretTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if jax.device_count("cpu") < 4:
      self.skipTest("needs XLA_FLAGS=--xla_force_host_platform_device_count=4 or more")
    self.enter_context(simulator.collective_interpret_mode(wait_timeout_s=30))

  @parameterized.parameters(2, 4)
  def test_ring_shift(self, num_devices):
    mesh = _mesh(num_devices)
    x = _sharded_input(0, mesh)
    out, scratch = _run(_ring_shift(num_devices), mesh, x, num_outputs=2)
    expected = _neighbour_shards(np.asarray(x), num_devices, offset=1)
    np.testing.assert_array_equal(np.asarray(scratch), expected)
    np.testing.assert_array_equal(np.asarray(out), expected)
    self.assertFalse(interpret.races_found())

  @parameterized.parameters((2, 2), (4, 2))
  def test_non_decrementing_wait_across_steps(self, num_devices, num_blocks):
    mesh = _mesh(num_devices)
    x = _sharded_input(1, mesh)
    out, _ = _run(_all_gather(num_devices, num_blocks), mesh, x, num_outputs=2)
    self.assertFalse(interpret.races_found())
    # Every device holds every shard, in device order.
    np.testing.assert_array_equal(np.asarray(out), np.tile(np.asarray(x), (num_devices, 1)))

  def _unsatisfiable_wait(self):
    num_devices = 2

    def body(x_gmem, out_gmem):
      del x_gmem, out_gmem
      sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
      right = lax.rem(lax.axis_index(AXIS) + 1, num_devices)
      pl.semaphore_signal(sem, device_id=right)
      pl.semaphore_wait(sem, 2)  # Only one signal ever comes.

    kernel = plgpu.kernel(body, out_type=(jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),),
                          interpret=interpret.interpret_params())
    return jax.jit(jax.shard_map(kernel, mesh=_mesh(num_devices), in_specs=P(AXIS),
                                 out_specs=(P(AXIS),), check_vma=False))

  def _assert_interpreter_works(self):
    mesh = _mesh(2)
    x = _sharded_input(2, mesh)
    out, _ = _run(_ring_shift(2), mesh, x, num_outputs=2)
    np.testing.assert_array_equal(np.asarray(out), _neighbour_shards(np.asarray(x), 2, 1))

  def test_unsatisfiable_wait_raises_timeout_error(self):
    x = _sharded_input(2, _mesh(2))
    with self.assertRaisesRegex(
        TimeoutError, r"(?s)^semaphore_wait .* on device [01] .*block 0.*"
        r"still waits after 0.5 s on semaphore \d+ .*wants a count >= 2, the count is 1"
    ) as caught:
      with simulator.collective_interpret_mode(wait_timeout_s=0.5):
        jax.block_until_ready(self._unsatisfiable_wait()(x))
    self.assertIsInstance(caught.exception.__cause__, jax.errors.JaxRuntimeError)
    # Leaving the block reset the interpreter.
    self._assert_interpreter_works()

  def test_wait_timeout_of_an_unawaited_kernel_is_raised_when_the_block_ends(self):
    # docs/testing.md's pattern: the block only starts the kernel (dispatch is asynchronous).
    x = _sharded_input(2, _mesh(2))
    with self.assertRaisesRegex(TimeoutError, r"^semaphore_wait .*still waits after 0.5 s"):
      with simulator.collective_interpret_mode(wait_timeout_s=0.5):
        out = self._unsatisfiable_wait()(x)
    del out
    self._assert_interpreter_works()

  def test_other_runtime_errors_pass_unchanged(self):
    error = jax.errors.JaxRuntimeError("INTERNAL: something else")
    with self.assertRaises(jax.errors.JaxRuntimeError) as caught:
      with simulator.collective_interpret_mode():
        raise error
    self.assertIs(caught.exception, error)

  @parameterized.named_parameters(
      ("correct", True, True, False),
      ("read_before_wait", False, True, True),
      ("signal_before_store_completes", True, False, True),
  )
  def test_races_across_devices(self, wait_before_read, signal_after_copy, racy):
    mesh = _mesh(2)
    x = _sharded_input(3, mesh)
    kernel = _ring_shift(2, wait_before_read=wait_before_read,
                         signal_after_copy=signal_after_copy)
    _run(kernel, mesh, x, num_outputs=2)
    self.assertEqual(interpret.races_found(), racy)

  @parameterized.named_parameters(("guarded", True), ("overwrite_while_peer_reads", False))
  def test_slot_reuse_across_devices(self, guarded):
    mesh = _mesh(2)
    x = _sharded_input(4, mesh)
    out, _ = _run(_slot_reuse(2, guarded=guarded), mesh, x, num_outputs=2)
    self.assertEqual(interpret.races_found(), not guarded)
    if guarded:
      np.testing.assert_array_equal(np.asarray(out), _neighbour_shards(np.asarray(x), 2, 1))

  def test_more_waiting_threads_than_xla_pool_threads(self):
    # 24 simulated threads; before the pool was sized this timed out.
    mesh = _mesh(4)
    x = _sharded_input(5, mesh)
    with simulator.collective_interpret_mode(wait_timeout_s=10):
      (out,) = _run(_per_slot_waits(4, num_blocks=2), mesh, x, num_outputs=1)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    self.assertFalse(interpret.races_found())

  def test_threads_compile_their_program_once_per_cpu_device(self):
    # 2 devices x 8 blocks x 3 warpgroups: 48 simulated threads, 24 per CPU
    # device. Each thread used to compile the program itself, all at once.
    mesh = _mesh(2)
    x = _sharded_input(7, mesh)
    compile_ = jax.stages.Lowered.compile
    with mock.patch.object(jax.stages.Lowered, "compile", autospec=True,
                           side_effect=compile_) as compiled:
      (out,) = _run(_per_slot_waits(2, num_blocks=8), mesh, x, num_outputs=1)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    self.assertEqual(compiled.call_count, 48 // thread_pool.THREADS_PER_CPU_DEVICE)

  def test_each_simulated_thread_has_run_to_its_end_when_it_returns(self):
    """`thread_map` takes a thread as finished when its program's call returns. XLA's
    CPU client ran many of these 48 threads' programs asynchronously (39 of 48
    returned before their kernel ended), so a device went on to the end of the grid
    step while its threads still ran: the 4-device rings then timed out on a
    semaphore short of its count, or left a barrier allocated, at random."""
    lock = threading.Lock()
    counts = {"finished": 0, "returned": 0, "early": 0}
    finished = gpu_callbacks.kernel_thread_finished
    run_thread = thread_map._run_jaxpr  # The simulator's, installed by setUp.

    def counting_finished(*args, **kwargs):
      with lock:
        counts["finished"] += 1
      return finished(*args, **kwargs)

    def checked_run_thread(*args):
      run_thread(*args)
      with lock:  # Every thread that returned must have ended, this one too.
        counts["returned"] += 1
        counts["early"] += counts["finished"] < counts["returned"]

    mesh = _mesh(2)
    x = _sharded_input(9, mesh)
    with mock.patch.object(gpu_callbacks, "kernel_thread_finished", counting_finished), \
        mock.patch.object(thread_map, "_run_jaxpr", checked_run_thread):
      (out,) = _run(_per_slot_waits(2, num_blocks=8), mesh, x, num_outputs=1)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    self.assertEqual(counts, {"finished": 48, "returned": 48, "early": 0})

  def test_too_small_xla_pool_is_refused(self):
    mesh = _mesh(4)
    x = _sharded_input(6, mesh)
    with mock.patch.object(thread_pool, "intra_op_pool_size", return_value=8):
      with self.assertRaisesRegex(
          NotImplementedError, r"24 concurrent simulated threads.*pool has only 8 threads"
          r".*PJRT_NPROC="):
        _run(_per_slot_waits(4, num_blocks=2), mesh, x, num_outputs=1)

  def test_warns_when_copies_outnumber_tma_threads(self):
    mesh = _mesh(2)
    x = _sharded_input(7, mesh)
    with self.assertLogs(simulator.__name__, "WARNING") as logs, \
        simulator.collective_interpret_mode(tma_threads_per_device=1):
      _run(_ring_shift(2), mesh, x, num_outputs=2)
    self.assertRegex(logs.output[0], "more than 2 TMA copies.*Raise tma_threads_per_device")
    with self.assertNoLogs(simulator.__name__, "WARNING"):
      _run(_ring_shift(2), mesh, x, num_outputs=2)

  def test_version_guard(self):
    with mock.patch.object(jax, "__version__", "0.12.0"):
      with self.assertRaisesRegex(
          NotImplementedError, r"jax 0\.11\.2; the installed jax is 0\.12\.0"):
        with simulator.collective_interpret_mode():
          pass


if __name__ == "__main__":
  absltest.main()
