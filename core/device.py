"""Facts about the GPU a kernel is compiled for.

On a machine with a GPU they are read from the device; in GPU interpret mode on
CPU (where `jax.Device.core_count` does not exist) they are the defaults of an
H100/H200, so that shared-memory budgets and persistent grids are sized exactly
as they would be on the hardware the kernels target.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import jax

# Hopper (sm_90) facts, the only architecture these kernels target. Every other
# module reads them from here; none repeats a number.
HOPPER_COMPUTE_CAPABILITY = (9, 0)
HOPPER_SM_COUNT = 132  # H100 SXM and H200 SXM.
HOPPER_SMEM_PER_BLOCK_BYTES = 232448  # 227 KiB, the opt-in per-block limit.
HOPPER_DENSE_16BIT_FLOPS = 989.4e12  # SXM datasheet, dense f16/bf16 with f32 accumulation.
# wgmma: one warpgroup (4 warps) computes a (64k, n) tile, n a multiple of 8 up
# to 256, consuming 16 elements of K per instruction with 16-bit operands.
WARPGROUP_THREADS = 128
WGMMA_M = 64
WGMMA_N_MULTIPLE = 8
WGMMA_MAX_N = 256
WGMMA_K_16BIT = 16

# cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).
_CU_ATTR_SMEM_PER_BLOCK_OPTIN = 97


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceFacts:
  """What a kernel needs to know about its GPU before it is compiled.

  Attributes:
    name: the device kind, e.g. "NVIDIA H200".
    compute_capability: (major, minor), e.g. (9, 0).
    sm_count: number of streaming multiprocessors: the persistent grid size.
    smem_per_block_bytes: the opt-in shared-memory limit of one thread block.
    dense_16bit_flops: peak dense f16/bf16 tensor-core rate, FLOP/s.
    simulated: True when these are defaults for interpret mode on CPU.
  """

  name: str
  compute_capability: tuple[int, int]
  sm_count: int
  smem_per_block_bytes: int
  dense_16bit_flops: float
  simulated: bool

  @property
  def is_hopper(self) -> bool:
    return self.compute_capability == HOPPER_COMPUTE_CAPABILITY


HOPPER_DEFAULTS = DeviceFacts(
    name="NVIDIA H100/H200 (defaults for interpret mode)",
    compute_capability=HOPPER_COMPUTE_CAPABILITY,
    sm_count=HOPPER_SM_COUNT,
    smem_per_block_bytes=HOPPER_SMEM_PER_BLOCK_BYTES,
    dense_16bit_flops=HOPPER_DENSE_16BIT_FLOPS,
    simulated=True,
)


def has_gpu() -> bool:
  """Whether JAX sees at least one CUDA GPU in this process."""
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def device_facts(device: jax.Device | None = None) -> DeviceFacts:
  """Returns the facts of `device`, the first GPU by default.

  With no GPU (interpret mode on CPU) returns `HOPPER_DEFAULTS`.
  """
  if device is None:
    if not has_gpu():
      return HOPPER_DEFAULTS
    device = jax.devices("gpu")[0]
  if device.platform != "gpu":
    return HOPPER_DEFAULTS
  return _gpu_facts(device.local_hardware_id, device.device_kind, device.core_count,
                    str(device.compute_capability))


@functools.cache
def _gpu_facts(device_id: int, kind: str, sm_count: int, cc: str) -> DeviceFacts:
  major, minor = (int(x) for x in cc.split("."))
  smem = _smem_per_block_from_driver(device_id) or HOPPER_SMEM_PER_BLOCK_BYTES
  # The tensor-core rate is not queryable; it scales with the SM count at the
  # Hopper SXM clock.
  flops = HOPPER_DENSE_16BIT_FLOPS * sm_count / HOPPER_SM_COUNT
  return DeviceFacts(
      name=kind,
      compute_capability=(major, minor),
      sm_count=sm_count,
      smem_per_block_bytes=smem,
      dense_16bit_flops=flops,
      simulated=False,
  )


def _smem_per_block_from_driver(device_ordinal: int) -> int | None:
  """Asks the CUDA driver for the opt-in shared memory per block, or None."""
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError:
    return None
  value = ctypes.c_int()
  dev = ctypes.c_int()
  if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), device_ordinal) != 0:
    return None
  if cuda.cuDeviceGetAttribute(
      ctypes.byref(value), _CU_ATTR_SMEM_PER_BLOCK_OPTIN, dev) != 0:
    return None
  return value.value
