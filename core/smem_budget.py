"""Shared-memory budgets, checked before anything is compiled.

A config that does not fit in SMEM otherwise fails deep inside Mosaic GPU's
lowering (`smem_bytes=... > max_smem_bytes=...`), after tracing. Kernel
wrappers describe their SMEM allocations with `SmemBudget` and call `check`
first, so a bad config gets an error that names it and its sizes, and the
autotuner can skip it without compiling.

The model follows how Pallas lays out SMEM (jax 0.11.2): every scratch
allocation starts at a 1024-byte boundary (the alignment swizzled TMA tiles
need), and mbarriers (8 bytes each) follow the buffers. Tests compare it with
the size Mosaic GPU itself computes for this repo's kernels.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import device

SMEM_ALIGNMENT_BYTES = 1024
MBARRIER_BYTES = 8
# What a scratch declaration may hold besides SMEM buffers: a cluster barrier
# is one mbarrier in each block of the cluster.
_BARRIERS = (plgpu.Barrier, plgpu.ClusterBarrier)


def align(nbytes: int, alignment: int = SMEM_ALIGNMENT_BYTES) -> int:
  return -(-nbytes // alignment) * alignment


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmemBuffer:
  """One SMEM allocation: `copies` slots of a `shape` tile (pipeline buffers)."""

  name: str
  shape: tuple[int, ...]
  dtype: jnp.dtype
  copies: int = 1

  @property
  def nbytes(self) -> int:
    return align(self.copies * math.prod(self.shape) * jnp.dtype(self.dtype).itemsize)

  def describe(self) -> str:
    slots = f"{self.copies} x " if self.copies != 1 else ""
    return f"{self.name}: {slots}{self.shape} {jnp.dtype(self.dtype).name} = {self.nbytes} B"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmemBudget:
  """The SMEM a kernel allocates.

  Attributes:
    phases: groups of buffers alive at the same time. Buffers of one phase add
      up; phases run one after another (sequential `pl.run_scoped` scopes) and
      reuse the same bytes, so the largest phase counts.
    num_barriers: mbarriers, 8 bytes each, allocated after the buffers.
  """

  phases: tuple[tuple[SmemBuffer, ...], ...]
  num_barriers: int = 0

  @property
  def total_bytes(self) -> int:
    largest = max((sum(b.nbytes for b in phase) for phase in self.phases), default=0)
    return largest + self.num_barriers * MBARRIER_BYTES

  @classmethod
  def of_scratch(cls, scratch: dict, *, labels: dict[str, tuple[str, ...]] | None = None
                 ) -> SmemBudget:
    """The budget of a kernel's scratch declaration: what it passes to `pl.run_scoped`.

    Args:
      scratch: name -> a pytree of `plgpu.SMEM` allocations, `plgpu.Barrier`s
        and `plgpu.ClusterBarrier`s (one mbarrier per block each; all alive at
        once).
      labels: names for the SMEM leaves of a multi-leaf entry, in order (by
        default `name[i]`).
    """
    buffers, num_barriers = [], 0
    for name, allocation in scratch.items():
      leaves = jax.tree.leaves(allocation)
      smem_leaves = [leaf for leaf in leaves if not isinstance(leaf, _BARRIERS)]
      names = (labels or {}).get(name) or (
          (name,) if len(smem_leaves) == 1
          else tuple(f"{name}[{i}]" for i in range(len(smem_leaves))))
      num_barriers += sum(math.prod(leaf.num_barriers) for leaf in leaves
                          if isinstance(leaf, _BARRIERS))
      for label, leaf in zip(names, smem_leaves, strict=True):
        if leaf.memory_space != plgpu.SMEM:
          raise ValueError(f"scratch {name!r} holds {leaf.memory_space}, not SMEM")
        buffers.append(SmemBuffer(name=label, shape=tuple(leaf.shape), dtype=leaf.dtype))
    return cls(phases=(tuple(buffers),), num_barriers=num_barriers)

  def describe(self) -> str:
    parts = [" + ".join(b.describe() for b in phase) for phase in self.phases]
    text = " | then | ".join(parts)
    if self.num_barriers:
      text += f"; {self.num_barriers} mbarriers = {self.num_barriers * MBARRIER_BYTES} B"
    return text

  def fits(self, limit: int | None = None) -> bool:
    return self.total_bytes <= _limit(limit)

  def check(self, *, what: str, limit: int | None = None) -> None:
    """Raises `ValueError` naming `what` if the budget exceeds `limit`.

    Args:
      what: the config being checked, e.g. `repr(config)`.
      limit: bytes available; the current device's per-block limit by default.
    """
    limit = _limit(limit)
    if self.total_bytes > limit:
      raise ValueError(
          f"{what} needs {self.total_bytes} bytes of shared memory, more than the "
          f"{limit} bytes a block can have ({self.describe()}). Use smaller tiles "
          "or fewer pipeline stages (max_concurrent_steps).")


def _limit(limit: int | None) -> int:
  return device.device_facts().smem_per_block_bytes if limit is None else limit
