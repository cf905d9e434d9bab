"""Multi-device GPU interpret mode: semaphores and peer memory on simulated devices.

Test and simulation support, never imported by kernels. jax 0.11.2's GPU
interpret mode runs one Mosaic GPU kernel per device of a `jax.shard_map` on
CPU devices but has no semaphores and no peer memory; this package patches
its private interpreter to add both (`pl.get_global`, `pl.semaphore_signal`,
`pl.semaphore_wait`, `pl.semaphore_read`, `plgpu.remote_ref` on GMEM refs),
with race detection across devices, and refuses any other jax version.
Races are reported where the interpreter reports them, so
`core.interpret.races_found()` sees them. They are found in the interleaving
that ran: a protocol that is only racy when one device runs ahead shows up
when it does (more often on a busy CPU). Tested on 1-D meshes.

The modules, one job each:
  * `collective_mode`: `collective_interpret_mode`, the entry point.
  * `patches`: `install`, the patches of jax's interpreter.
  * `semaphore_rewrite`: a traced kernel's semaphore operations, turned into
    calls of the simulated semaphores.
  * `semaphores`: the semaphores at run time (counts, clocks, wait timeouts).
  * `thread_pool`: XLA's CPU threads that simulated threads occupy.

Importing the package changes nothing. Every simulated thread is a CPU thread
(devices x blocks x `num_threads`; keep grids small), and one that waits
blocks a thread of XLA's intra-op pool, so a test program sizes that pool
before jax starts its CPU backend:

    import simulator
    simulator.reserve_intra_op_threads()  # Or PJRT_NPROC=128 in the environment.
    ...
    with simulator.collective_interpret_mode(wait_timeout_s=60):
      out = jax.jit(jax.shard_map(kernel_fn, mesh=mesh, ...))(x)
    assert not interpret.races_found()

Kernels are unchanged: they pass `interpret=interpret_params()` as before. The
block waits for the kernels it started when it ends, so a semaphore wait
timeout is raised by the `with` statement at the latest, as a `TimeoutError`.
"""

from simulator.collective_mode import collective_interpret_mode
from simulator.patches import check_jax_version, install
from simulator.semaphores import DEFAULT_WAIT_TIMEOUT_S
from simulator.thread_pool import INTRA_OP_THREADS, intra_op_pool_size, reserve_intra_op_threads

__all__ = [
    "DEFAULT_WAIT_TIMEOUT_S", "INTRA_OP_THREADS", "check_jax_version", "collective_interpret_mode",
    "install", "intra_op_pool_size", "reserve_intra_op_threads",
]
