"""The `plgpu.CompilerParams` knobs this repo's kernels use, validated in one place.

`compiler_params(...)` is what every kernel wrapper passes to `plgpu.kernel` or
`pl.pallas_call`. It also implements the repo-wide way to get Mosaic GPU's
in-kernel profile trace of any kernel:

    MGPU_PROFILE_DIR=/tmp/traces bazel run //examples:quickstart

writes one Perfetto-compatible JSON trace per kernel launch into that folder
(`MGPU_PROFILE_SPACE` sets the events recorded per warpgroup, default 64).
Open it in ui.perfetto.dev. Each `jax.named_scope` inside a kernel body is one
region of the trace: the warp-specialized matmul names its K loop and
epilogue ("k_loop", "epilogue"), the ring kernels their steps and
synchronization ("ring_step", "ring_signal", "ring_wait"). Profiling costs
SMEM and time, and it distorts: a step of the all-gather ring that forwards
its LHS ran 3.5x slower traced than untraced. Never benchmark with it on.

`delay_release` and `max_concurrent_steps` are pipeline knobs. With jax 0.11.2,
`max_concurrent_steps` is a `CompilerParams` field (used by the `pallas_call`
compatibility path), while `delay_release` is a field of each `plgpu.BlockSpec`;
`PipelineOptions.block_spec` puts it there.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from jax.experimental.pallas import mosaic_gpu as plgpu

from core import jax_private

# Mosaic GPU tracks the phases of an array of barriers in one 32-bit mask.
MAX_BARRIERS_PER_ARRAY = 32

PROFILE_DIR_ENV = "MGPU_PROFILE_DIR"
PROFILE_SPACE_ENV = "MGPU_PROFILE_SPACE"
DEFAULT_PROFILE_SPACE = 64
DIMENSION_SEMANTICS = ("parallel", "sequential")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineOptions:
  """How deep a pipeline runs.

  Attributes:
    max_concurrent_steps: SMEM slots per pipelined input (>= 1). More slots
      hide more load latency and cost SMEM.
    delay_release: steps a slot stays alive after its step ran (>= 0, smaller
      than max_concurrent_steps). 1 lets a step leave its wgmma in flight
      (`wgmma_wait(1)`) while the next step's loads proceed.
  """

  max_concurrent_steps: int = 2
  delay_release: int = 0

  def __post_init__(self):
    if not isinstance(self.max_concurrent_steps, int) or self.max_concurrent_steps < 1:
      raise ValueError(
          f"max_concurrent_steps must be an int >= 1, got {self.max_concurrent_steps!r}")
    if not isinstance(self.delay_release, int) or self.delay_release < 0:
      raise ValueError(f"delay_release must be an int >= 0, got {self.delay_release!r}")
    if self.delay_release >= self.max_concurrent_steps:
      raise ValueError(
          f"delay_release={self.delay_release} must be smaller than max_concurrent_steps="
          f"{self.max_concurrent_steps}: a slot cannot be held longer than the pipeline is deep")

  def steps_for(self, num_steps: int) -> int:
    """The slots the pipeline really allocates: it clamps to the number of steps."""
    if num_steps < 1:
      raise ValueError(f"a pipeline needs at least one step, got {num_steps}")
    return min(self.max_concurrent_steps, num_steps)

  def block_spec(self, block_shape, index_map, *, transforms=()) -> plgpu.BlockSpec:
    """A `plgpu.BlockSpec` for a pipelined SMEM input with this `delay_release`."""
    return plgpu.BlockSpec(block_shape, index_map, transforms=transforms,
                           delay_release=self.delay_release)


def compiler_params(
    *,
    approx_math: bool = False,
    unsafe_no_auto_barriers: bool = False,
    reduction_scratch_bytes: int | None = None,
    skip_device_barrier: bool = False,
    dimension_semantics: Sequence[str] | None = None,
    max_concurrent_steps: int = 1,
    profile_dir: str | None = None,
    profile_space: int | None = None,
) -> plgpu.CompilerParams:
  """Validated `plgpu.CompilerParams`.

  Args:
    approx_math: allow approximate `exp`, `tanh`, ... (faster epilogues).
    unsafe_no_auto_barriers: skip Pallas' conservative barriers; only for
      kernels that never read and write one SMEM region from one thread.
    reduction_scratch_bytes: SMEM reserved for cross-warp reductions (>= 0).
    skip_device_barrier: skip the cross-device barrier before a collective
      kernel starts; only safe when the kernel synchronizes its peers itself.
    dimension_semantics: "parallel" or "sequential" per grid dimension
      (`pl.pallas_call` path only); sequential dimensions are pipelined.
    max_concurrent_steps: pipeline depth of the `pl.pallas_call` path.
    profile_dir, profile_space: Mosaic GPU's in-kernel profiler; set both or
      neither. Default to `MGPU_PROFILE_DIR`/`MGPU_PROFILE_SPACE`.

  Also makes Mosaic GPU copy tiles one swizzle segment wide as 2D boxes
  (`jax_private.copy_one_segment_tiles_as_boxes`), which the padding rules of
  the kernel wrappers (`core.tma_copies_in_place`) count on.
  """
  jax_private.copy_one_segment_tiles_as_boxes()
  if reduction_scratch_bytes is not None and reduction_scratch_bytes < 0:
    raise ValueError(f"reduction_scratch_bytes must be >= 0, got {reduction_scratch_bytes}")
  if dimension_semantics is not None:
    dimension_semantics = tuple(dimension_semantics)
    bad = [d for d in dimension_semantics if d not in DIMENSION_SEMANTICS]
    if bad:
      raise ValueError(
          f"dimension_semantics={dimension_semantics}: {bad} are not among {DIMENSION_SEMANTICS}")
  PipelineOptions(max_concurrent_steps=max_concurrent_steps)  # Validates the depth.
  if profile_dir is None and profile_space is None:
    profile_dir = os.environ.get(PROFILE_DIR_ENV) or None
    if profile_dir is not None:
      profile_space = int(os.environ.get(PROFILE_SPACE_ENV, DEFAULT_PROFILE_SPACE))
  if (profile_dir is None) != (profile_space is None):
    raise ValueError(
        f"profile_dir={profile_dir!r} and profile_space={profile_space!r} must be set together")
  if profile_space is not None and profile_space <= 0:
    raise ValueError(f"profile_space must be positive, got {profile_space}")
  kwargs = {}
  if reduction_scratch_bytes is not None:
    kwargs["reduction_scratch_bytes"] = reduction_scratch_bytes
  return plgpu.CompilerParams(
      approx_math=approx_math,
      unsafe_no_auto_barriers=unsafe_no_auto_barriers,
      skip_device_barrier=skip_device_barrier,
      dimension_semantics=dimension_semantics,
      max_concurrent_steps=max_concurrent_steps,
      profile_dir=profile_dir or "",
      profile_space=profile_space or 0,
      **kwargs,
  )


def sequential_grid_semantics(num_parallel: int) -> tuple[str, ...]:
  """`num_parallel` parallel dimensions followed by one pipelined sequential one."""
  return ("parallel",) * num_parallel + ("sequential",)


