"""The ring matmul + reduce-scatter on Hopper: NVLink transfers hidden under wgmma.

Inside `jax.shard_map` over D devices, device d holds lhs_d (M, K_shard) and
rhs_d (K_shard, N) (K sharded, as after a tensor-parallel row-parallel
layer) and gets row block d (M / D rows) of `sum_i lhs_i @ rhs_i`. It never
materializes its full (M, N) partial product: at step s it multiplies one
row block of its LHS (`reduce_scatter_schedule.py`) with the
warp-specialized cooperative matmul, whose epilogue adds the running sum of
that block received from the ring successor (`addend_gmem`) and stores the
new sum with TMA straight into the ring predecessor's scratch slot (a
`plgpu.remote_ref`). So each tile's NVLink store runs while the tensor cores
work on the next tile. At the last step the block is the device's own and
its sum is final: it is cast and stored to the output.

The partial sums in flight are in the output dtype on 2 devices and in
float32 on more (`partial_dtype`). Measured in the simulator against a
float32 reference: K_shard = 2048, a 128 x 64 output block per device,
operands and output of one dtype, relative error ||out - ref|| / ||ref||
with float32 partials vs partials in the output dtype:

  D   bfloat16: float32 / bfloat16 partials   float16: float32 / float16 partials
  2             1.65e-3 / 2.02e-3                      2.03e-4 / 2.48e-4
  4             1.66e-3 / 2.62e-3                      2.08e-4 / 3.30e-4
  8             1.67e-3 / 3.52e-3                      2.09e-4 / 4.40e-4

With float32 partials the only rounding is the final cast, so the error is
that of a plain matmul whatever D. Rounding every running sum to the output
dtype adds a rounding per hop: the error grows with D (2.1x at D = 8), and
at D = 8 in bfloat16 9 of the 65536 elements already fall outside the
element-wise bound the tests hold every kernel to (`core.numerics`). At
D = 2 one partial travels, rounded once (1.2x the error, no element outside
the bound), and the 16-bit sums halve the NVLink bytes: on 2 H200s at the
benchmark's size (per device lhs (2048, 4096), rhs (4096, 4096), float16)
the ring took 148 us with float32 partials and 126 us with float16 ones
(NCCL reduce-scatter + cuBLAS: 191 us; lower bound 95 us). Most of a
step's NVLink stores are not hidden under the next step's K loop: see
docs/performance-log.md, "Matmul + reduce-scatter ring: first runs on hardware", for the
measurements and what was tried.

Synchronization, per step s < D - 1 (a send):
  * every compute warpgroup of every block stores its tiles of the sum to
    the predecessor's slot s with TMA, then waits until those stores have
    landed (`wait_smem_to_gmem(0, wait_read_only=False)`: not merely read
    out of SMEM) and signals the predecessor's semaphore of slot s;
  * before step s + 1 reads slot s (as its addend), each compute warpgroup
    of the receiver waits until that semaphore counts a signal from every
    compute warpgroup of every sender block (`signals_per_slot`). Never
    decremented, so every warpgroup of the device can wait on the same
    count; one semaphore per slot, since blocks do not run in lockstep;
  * each slot is written once (D - 1 slots), so no sender ever overwrites a
    sum its receiver has yet to read, and nothing waits for a reader;
  * nothing is in flight when a device's kernel exits: it waited for every
    slot it receives before its last step, and for every store it sent
    before signalling it.
The wait sits before the step's K loop, where it is simplest to see safe;
waiting just before each tile's epilogue instead would let the first tile's
wgmmas overlap the successor's last stores of the previous step (a tuning
step for the GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from collectives import operands, ring_config, topology
from collectives import reduce_scatter_schedule as schedule
from core import device_facts, is_interpreting
from core.varying import vary_over, varying_axes
from pipelines import (
    WG_AXIS,
    TuningConfig,
    check_ws_config,
    emit_cooperative_matmul,
    persistent_kernel,
)
from pipelines.config import NUM_COMPUTE_WGS
from pipelines.operands import MatmulProblem

# The dtype of the running sums that travel between devices (see the module
# docstring for the measurement behind it).
FLOAT32_PARTIALS = jnp.dtype(jnp.float32)


def partial_dtype(num_devices: int, out_dtype) -> jnp.dtype:
  """The dtype of the running sums that travel between devices (see the module docstring).

  The output dtype on 2 devices, where the one partial that travels is
  rounded once; float32 on more, where a 16-bit sum would be rounded at
  every hop.
  """
  return jnp.dtype(out_dtype) if num_devices == 2 else FLOAT32_PARTIALS


def check_reduce_scatter_config(config: TuningConfig, block: MatmulProblem, out_dtype) -> None:
  """Raises ValueError unless this kernel can run `config` on the per-device block `block`.

  `block` is (M / D, K_shard, N): the CTA tile must divide its M and N (every
  tile is stored whole, to a peer or the output, and its addend is loaded
  unmasked), and `config` must pass `check_ws_config` with the epilogue
  staging of every dtype the kernel may store: `out_dtype` and float32 (the
  partials on more than 2 devices), so that a config holds for any D.
  """
  for name, size, tile in (("M / D (lhs.shape[0] / devices)", block.m, config.cta_tile_m),
                           ("N (rhs.shape[1])", block.n, config.cta_tile_n)):
    if size % tile:
      raise ValueError(f"{name}={size} must be a multiple of the CTA tile {tile} of {config}")
  for stored in dict.fromkeys((jnp.dtype(out_dtype), FLOAT32_PARTIALS)):
    check_ws_config(config, block, stored, kernel="the reduce-scatter ring")


def _busiest_sm_elements(config: TuningConfig, block: MatmulProblem) -> int:
  """Output elements the busiest SM computes per ring step: a proxy for its time."""
  num_tiles = (block.m // config.cta_tile_m) * (block.n // config.cta_tile_n)
  return -(-num_tiles // device_facts().sm_count) * config.cta_tile_m * config.cta_tile_n


def ring_reduce_scatter_config(problem: MatmulProblem, out_dtype) -> TuningConfig | None:
  """A config the reduce-scatter ring can run on the per-device block `problem`.

  Args:
    problem: (M / D, K_shard, N) and the operand dtype: one step's matmul.
    out_dtype: the output dtype (float16 or bfloat16).

  Returns:
    Of the all-gather ring's tiles (`ring_config.RING_TILES`) that divide the
    block, the one whose busiest SM computes the fewest output elements per
    step, with the deepest of `ring_config.RING_STAGES` that passes
    `check_reduce_scatter_config`; None where none does.
  """
  dividing = [tiles for tiles in ring_config.RING_TILES if ring_config.divides(tiles, problem)]
  # sorted() is stable: among equal costs, the earlier (larger) tile stays first.
  for tiles in sorted(dividing, key=lambda tiles: _busiest_sm_elements(tiles, problem)):
    for steps, epi_tile_n in ring_config.RING_STAGES:
      config = dataclasses.replace(tiles, max_concurrent_steps=steps,
                                   epi_tile_n=min(epi_tile_n, tiles.tile_n))
      try:
        check_reduce_scatter_config(config, problem, out_dtype)
      except ValueError:
        continue  # Too deep for SMEM (float32 staging), or a K the tile cannot step through.
      return config
  return None


def _ring_kernel(lhs_gmem, rhs_gmem, out_gmem, recv_gmem, *, axis_name, num_devices: int,
                 num_blocks: int, config: TuningConfig):
  if num_devices == 1:
    # Nothing to reduce, and no peer: keep remote refs and semaphores out of
    # the kernel so that it runs where peer access does not exist.
    emit_cooperative_matmul(lhs_gmem, rhs_gmem, out_gmem, config=config)
    return
  block_m = out_gmem.shape[0]
  # received.at[slot] counts the sender's warpgroups whose stores to the slot landed.
  received = pl.get_global(
      plgpu.SemaphoreType.REGULAR((schedule.num_scratch_slots(num_devices),)))
  signals = schedule.signals_per_slot(num_blocks, NUM_COMPUTE_WGS)
  device = lax.axis_index(axis_name)
  peer = schedule.send_target(device, num_devices)
  peer_recv_gmem = plgpu.remote_ref(recv_gmem, peer)
  # The compute warpgroups read the addend and store the sums; the memory
  # warpgroup only loads LHS and RHS tiles, which no device ever writes, so
  # it neither waits nor signals and may run ahead into the next step.
  is_compute_wg = lax.axis_index(WG_AXIS) < NUM_COMPUTE_WGS

  def device_step(step, *, adds: bool, sends: bool):
    block = schedule.block_at_step(device, step, num_devices)
    addend_gmem = None
    if adds:
      addend_gmem = recv_gmem.at[schedule.read_slot(step)]

      @pl.when(is_compute_wg)
      def _wait():
        # The epilogue reads every tile of the slot, which any warpgroup of
        # any block of the successor may have stored: wait for all of them.
        pl.semaphore_wait(received.at[schedule.read_slot(step)], value=signals,
                          decrement=False)

    out = peer_recv_gmem.at[schedule.send_slot(step)] if sends else out_gmem
    emit_cooperative_matmul(lhs_gmem.at[pl.ds(block * block_m, block_m)], rhs_gmem, out,
                            config=config, addend_gmem=addend_gmem)
    if sends:
      @pl.when(is_compute_wg)
      def _signal():
        # TMA completion is tracked per issuing warpgroup, so each waits for
        # its own stores, and until they have landed in the peer's memory,
        # not merely left SMEM: the peer reads the slot once signalled.
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        pl.semaphore_signal(received.at[schedule.send_slot(step)], device_id=peer)

  # Three instances of the matmul: the first step adds nothing, the last one
  # stores the output (in its dtype), the steps between do both.
  device_step(0, adds=False, sends=True)
  if num_devices > 2:
    @pl.loop(1, num_devices - 1)
    def _middle(step):
      device_step(step, adds=True, sends=True)
  device_step(num_devices - 1, adds=True, sends=False)


def ring_matmul_reduce_scatter(lhs: jax.Array, rhs: jax.Array, axis_name, *,
                               config: TuningConfig, dtype=None) -> jax.Array:
  """`psum_scatter(lhs @ rhs, axis_name)` with the Mosaic ring kernel; call inside `jax.shard_map`.

  The mesh axis must span every device of the job, with one process for all
  GPUs (or one per GPU where NVSHMEM is available), on Hopper GPUs. On one
  device it is the plain matmul.

  Args:
    lhs: (M, K_shard) float16 or bfloat16, this device's columns of the LHS;
      M a multiple of D * `config.cta_tile_m`.
    rhs: (K_shard, N) of the same dtype, this device's rows of the RHS; N a
      multiple of `config.cta_tile_n`, K_shard of `config.tile_k`.
    axis_name: the mesh axis K is sharded over (D devices).
    config: the warp-specialized matmul's config for one step's block
      problem (M / D, K_shard, N); `ring_reduce_scatter_config` gives one.
    dtype: output dtype, float16 or bfloat16; the operand dtype by default.

  Returns:
    (M / D, N) of `dtype`: row block d (this device's index on the axis) of
    `sum_i lhs_i @ rhs_i`, accumulated in float32; the partial sums travel
    in `partial_dtype(D, dtype)`.
  """
  interpreting = is_interpreting()
  # Simulated devices (interpret mode) may be a part of the job's CPU devices.
  num_devices = topology.ring_axis_size(axis_name, span_all_devices=not interpreting)
  problem, out_dtype = operands.check_shards(lhs, rhs, dtype, config,
                                             op="the matmul + reduce-scatter")
  if problem.m % num_devices:
    raise ValueError(f"M (lhs.shape[0]={problem.m}) must be a multiple of the {num_devices} "
                     f"devices of mesh axis {axis_name!r}: each gets M / D rows")
  block = dataclasses.replace(problem, m=problem.m // num_devices)
  if problem.is_empty:
    return vary_over(jnp.zeros((block.m, block.n), out_dtype),
                     varying_axes((lhs, rhs)) | {axis_name})
  check_reduce_scatter_config(config, block, out_dtype)
  if not interpreting:
    support = topology.mosaic_ring_support(num_devices)
    if not support.supported:
      raise NotImplementedError(f"the Mosaic ring kernel cannot run here: {support.reason}")
  num_tiles = (block.m // config.cta_tile_m) * (block.n // config.cta_tile_n)
  num_blocks = min(device_facts().sm_count, num_tiles)
  kernel = persistent_kernel(
      functools.partial(_ring_kernel, axis_name=axis_name, num_devices=num_devices,
                        num_blocks=num_blocks, config=config),
      out_type=(
          jax.ShapeDtypeStruct((block.m, block.n), out_dtype),
          # Where the D - 1 running sums sent by the ring successor land.
          jax.ShapeDtypeStruct((max(schedule.num_scratch_slots(num_devices), 1), block.m,
                                block.n), partial_dtype(num_devices, out_dtype)),
      ),
      num_blocks=num_blocks,
      name="ring_matmul_reduce_scatter",
      collective_axes=(axis_name,),
  )
  out, _ = kernel(lhs, rhs)
  return out
