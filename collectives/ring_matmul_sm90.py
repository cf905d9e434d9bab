"""The ring all-gather matmul on Hopper: NVLink transfers hidden under wgmma.

Inside `jax.shard_map` over D devices, device d holds an (M_shard, K) LHS shard
(data parallel) and a (K, N_shard) RHS shard (tensor parallel) and computes all
D row blocks of `all_gather(lhs) @ rhs_d`. It never waits for a full
all-gather: at step i it multiplies the shard it holds (`schedule.py`), and
the warp-specialized matmul's own TMA loads of that shard into SMEM are sent
on to the ring predecessor from SMEM (`pipeline_callback`), so the transfer
costs no extra GMEM reads and runs while the tensor cores work.

Synchronization, per step:
  * each LHS tile is sent once, by one of the blocks that load it
    (`forward_lhs_tiles`), as a TMA copy from its pipeline SMEM slot;
    `delay_release=1` keeps the slot alive one step longer, and the next
    step's callback waits for the copy to finish reading it;
  * after its share of the step, every block of the sender waits until its
    copies have landed in the peer's GMEM and signals the peer's semaphore of
    that scratch slot;
  * before reading scratch slot i, every block of the receiver waits until that
    slot's semaphore counts a signal from every block of the sender (one
    semaphore per slot: blocks do not run in lockstep, so a count shared by
    all steps could be completed by a block that is a step ahead).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from collectives import operands, schedule, topology
from core import device_facts, is_interpreting
from pipelines import (
    WG_AXIS,
    TuningConfig,
    check_ws_config,
    emit_cooperative_matmul,
    persistent_kernel,
)

# The slot of a forwarded LHS tile stays alive one extra pipeline step, which
# is the time its TMA copy to the peer gets to read it.
SEND_DELAY_RELEASE = 1
# Compute warpgroup that issues the sends: one is enough, its CTA tile
# includes the rows of both warpgroups.
SENDER_WG = 0


def check_ring_config(config: TuningConfig, problem, out_dtype) -> None:
  """Raises ValueError unless this kernel can run `config` on the shard `problem`.

  The CTA tile must divide M_shard and N_shard, and the config be cooperative,
  unsplit and fit SMEM with `SEND_DELAY_RELEASE` (see `ring_config`).
  """
  for name, size, tile in (("M_shard (lhs.shape[0])", problem.m, config.cta_tile_m),
                           ("N_shard (rhs.shape[1])", problem.n, config.cta_tile_n)):
    if size % tile:
      raise ValueError(f"{name}={size} must be a multiple of the CTA tile {tile} of {config}")
  check_ws_config(config, problem, out_dtype, delay_release=SEND_DELAY_RELEASE,
                  kernel="the all-gather ring")


def forward_lhs_tiles(dst_gmem, *, cta_tile_m: int, tile_k: int, n_tiles: int, enabled):
  """A `pipeline_callback` that copies each LHS tile the pipeline loads to `dst_gmem`.

  Args:
    dst_gmem: (M, K) GMEM ref (local or `plgpu.remote_ref`) laid out like the
      matmul's LHS.
    n_tiles: the output tiles of an M row band (N / CTA tile_n): every one of
      them loads the band's LHS tiles.
    enabled: traced bool; only the warpgroup and steps where it holds send.

  Each LHS tile is sent once, by the band's N tile `k_step % n_tiles`, so the
  sends spread evenly over all the blocks that compute the band. (Sending a
  band from its first N tile alone left those few blocks a step's worth of
  NVLink traffic each, which every block of the peer then waited for: the
  ring at M_shard 512 took 70 us against 59 us spread.) Must run with
  `delay_release=SEND_DELAY_RELEASE`.
  """
  def callback(m_tile, n_tile, k_step, lhs_smem):
    sends_tile = k_step % n_tiles == n_tile

    @pl.when(enabled & sends_tile)
    def _send():
      plgpu.copy_smem_to_gmem(
          lhs_smem, dst_gmem.at[pl.ds(m_tile * cta_tile_m, cta_tile_m),
                                pl.ds(k_step * tile_k, tile_k)])
      # This slot stays alive one more step; the previous step's slot is
      # released after this step, so its copy must be done reading now.
      plgpu.wait_smem_to_gmem(SEND_DELAY_RELEASE, wait_read_only=True)

    @pl.when(enabled & ~sends_tile)
    def _drain():
      # Nothing sent this step, so the last copy (if any) read the previous
      # step's slot, which is released after this step.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return callback


def _ring_kernel(lhs_gmem, rhs_gmem, out_gmem, recv_gmem, *, axis_name, num_devices: int,
                 num_blocks: int, config: TuningConfig):
  if num_devices == 1:
    # Nothing to gather, and no peer: keep remote refs and semaphores out of
    # the kernel so that it runs where peer access does not exist.
    emit_cooperative_matmul(lhs_gmem, rhs_gmem, out_gmem, config=config)
    return
  m_shard = lhs_gmem.shape[0]
  # received.at[slot] counts the sender's blocks whose part of the slot landed.
  received = pl.get_global(
      plgpu.SemaphoreType.REGULAR((schedule.num_scratch_slots(num_devices),)))
  device = lax.axis_index(axis_name)
  peer = schedule.send_target(device, num_devices)
  peer_recv_gmem = plgpu.remote_ref(recv_gmem, peer)
  is_sender_wg = lax.axis_index(WG_AXIS) == SENDER_WG

  def device_step(lhs_src_gmem, step):
    sends = schedule.sends_at_step(step, num_devices)
    shard = schedule.shard_at_step(device, step, num_devices)
    send = forward_lhs_tiles(peer_recv_gmem.at[schedule.send_slot(step)],
                             cta_tile_m=config.cta_tile_m, tile_k=config.tile_k,
                             n_tiles=rhs_gmem.shape[1] // config.cta_tile_n,
                             enabled=is_sender_wg & sends)
    with jax.named_scope("ring_step"):
      emit_cooperative_matmul(lhs_src_gmem, rhs_gmem,
                              out_gmem.at[pl.ds(shard * m_shard, m_shard)], config=config,
                              pipeline_callback=send, delay_release=SEND_DELAY_RELEASE)

    @pl.when(is_sender_wg & sends)
    def _signal():
      # The peer may read the slot only once the writes have landed, not
      # merely once this block's SMEM was read.
      with jax.named_scope("ring_signal"):
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        pl.semaphore_signal(received.at[schedule.send_slot(step)], device_id=peer)

    @pl.when(sends)
    def _wait():
      # Every block reads every M tile of the next shard, which other blocks
      # of the sender may have forwarded: wait for all of them. Never
      # decremented, so every block of this device can wait on the same count.
      with jax.named_scope("ring_wait"):
        pl.semaphore_wait(received.at[schedule.read_slot(step + 1)],
                          value=schedule.signals_per_slot(num_blocks), decrement=False)

  # Step 0 reads the local shard; later steps read what the successor sent.
  device_step(lhs_gmem, 0)

  @pl.loop(1, num_devices)
  def _steps(step):
    device_step(recv_gmem.at[schedule.read_slot(step)], step)


def all_gather_lhs_matmul(lhs: jax.Array, rhs: jax.Array, axis_name, *, config: TuningConfig,
                          dtype=None) -> jax.Array:
  """`all_gather(lhs, axis_name) @ rhs` with the Mosaic ring kernel; call inside `jax.shard_map`.

  The mesh axis must span every device of the job, with one process for all
  GPUs (or one per GPU where NVSHMEM is available), on Hopper GPUs.

  Args:
    lhs: (M_shard, K) float16 or bfloat16, this device's rows; M_shard a
      multiple of `config.cta_tile_m`.
    rhs: (K, N_shard) of the same dtype, this device's columns; N_shard a
      multiple of `config.cta_tile_n`, K of `config.tile_k`.
    axis_name: the mesh axis the LHS is sharded over (D devices).
    config: the warp-specialized matmul's config (`pipelines.TuningConfig`).
    dtype: output dtype, float16 or bfloat16; the operand dtype by default.

  Returns:
    (D * M_shard, N_shard) of `dtype`: row block j is `lhs_j @ rhs`, with
    float32 accumulation.
  """
  interpreting = is_interpreting()
  # Simulated devices (interpret mode) may be a part of the job's CPU devices.
  num_devices = topology.ring_axis_size(axis_name, span_all_devices=not interpreting)
  problem, out_dtype = operands.check_shards(lhs, rhs, dtype, config)
  check_ring_config(config, problem, out_dtype)
  if not interpreting:
    support = topology.mosaic_ring_support(num_devices)
    if not support.supported:
      raise NotImplementedError(f"the Mosaic ring kernel cannot run here: {support.reason}; "
                                "use collectives.all_gather_matmul, which falls back to the "
                                "portable XLA ring")
  num_tiles = (problem.m // config.cta_tile_m) * (problem.n // config.cta_tile_n)
  num_blocks = min(device_facts().sm_count, num_tiles)
  kernel = persistent_kernel(
      functools.partial(_ring_kernel, axis_name=axis_name, num_devices=num_devices,
                        num_blocks=num_blocks, config=config),
      out_type=(
          jax.ShapeDtypeStruct((num_devices * problem.m, problem.n), out_dtype),
          # Where the D - 1 shards forwarded by the ring successor land.
          jax.ShapeDtypeStruct((max(schedule.num_scratch_slots(num_devices), 1), problem.m,
                                problem.k), problem.dtype),
      ),
      num_blocks=num_blocks,
      name="ring_all_gather_matmul",
      collective_axes=(axis_name,),
  )
  out, _ = kernel(lhs, rhs)
  return out
