"""Where the ring kernel can run: the mesh axis, the process layout, NVLink peers.

Mosaic GPU reaches peer memory (`plgpu.remote_ref`) and peer semaphores in one
of two ways (jax 0.11.2, `jax/experimental/mosaic/gpu/core.py`):
  * one process drives every GPU: XLA's collective metadata, no extra library;
  * one process per GPU: NVSHMEM, which needs the `nvidia-nvshmem` wheel and
    `--xla_gpu_experimental_enable_nvshmem` in XLA_FLAGS, and a jaxlib built
    with it (the CUDA jaxlib this repo pins rejects that flag).
Everything here is decided at trace time, before a kernel is compiled.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
from jax import lax

from core import device_facts, jax_private


class ProcessLayout(enum.Enum):
  ONE_PROCESS = "one process for all devices"
  ONE_PER_DEVICE = "one process per device"
  OTHER = "several devices in each of several processes"


def process_layout() -> ProcessLayout:
  if jax.process_count() == 1:
    return ProcessLayout.ONE_PROCESS
  if jax.device_count() == jax.process_count():
    return ProcessLayout.ONE_PER_DEVICE
  return ProcessLayout.OTHER


def nvshmem_available() -> bool:
  """Whether Mosaic GPU would reach peers through NVSHMEM in this process."""
  return jax_private.nvshmem_available()


def ring_axis_size(axis_name, *, span_all_devices: bool) -> int:
  """Size of mesh axis `axis_name`; with `span_all_devices`, it must cover the whole job.

  Raises ValueError outside `jax.shard_map` over that axis, or when
  `span_all_devices` and the axis covers only part of the devices (the Mosaic
  kernel's peers are the job's devices, as JAX's own collective kernels assume).
  """
  try:
    size = lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(f"axis_name={axis_name!r} is not a mesh axis in scope: call this inside "
                     f"jax.shard_map over a mesh with that axis") from e
  if span_all_devices and size != jax.device_count():
    raise ValueError(f"mesh axis {axis_name!r} has {size} devices but the job has "
                     f"{jax.device_count()}: the ring must span every device (use a 1-D mesh "
                     f"over jax.devices())")
  return size


@dataclasses.dataclass(frozen=True)
class RingSupport:
  """Whether the Mosaic ring kernel can run here, and why (for logs and errors)."""

  supported: bool
  reason: str


def mosaic_ring_support(num_devices: int) -> RingSupport:
  """Whether the Mosaic ring kernel can run over a mesh axis of `num_devices` devices."""
  if num_devices != jax.device_count():
    return RingSupport(False, f"the axis covers {num_devices} of the job's {jax.device_count()} "
                       "devices; the kernel needs all of them")
  if jax.default_backend() != "gpu":
    return RingSupport(False, f"the backend is {jax.default_backend()!r}, not a GPU")
  not_hopper = [d for d in jax.local_devices() if not device_facts(d).is_hopper]
  if not_hopper:
    return RingSupport(False, f"{not_hopper[0].device_kind} is not a Hopper (sm_90) GPU")
  layout = process_layout()
  if layout == ProcessLayout.OTHER:
    return RingSupport(False, f"{jax.process_count()} processes with "
                       f"{jax.local_device_count()} devices each: the kernel needs one "
                       "process per GPU or one process for all GPUs")
  if layout == ProcessLayout.ONE_PER_DEVICE and num_devices > 1 and not nvshmem_available():
    return RingSupport(False, "one process per GPU needs NVSHMEM (the nvidia-nvshmem wheel and "
                       "XLA_FLAGS=--xla_gpu_experimental_enable_nvshmem), which this jaxlib "
                       "does not have; run one process for all GPUs of the host instead")
  if layout == ProcessLayout.ONE_PROCESS:
    return RingSupport(True, f"one process drives all {num_devices} GPUs (peer access over "
                       "NVLink through XLA's collective metadata)")
  return RingSupport(True, f"{num_devices} processes reach their peers through NVSHMEM")
