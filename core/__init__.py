"""Shared kernel machinery: device facts, memory spaces, SMEM budgets,
compiler options and the interpret-mode switch. Knows nothing of matmuls."""

from core.compiler import PipelineOptions, compiler_params, sequential_grid_semantics
from core.device import HOPPER_DEFAULTS, DeviceFacts, device_facts, has_gpu
from core.interpret import interpret_mode, interpret_params, is_interpreting, races_found
from core.memory import (
    GMEM,
    REGS,
    SMEM,
    TMEM,
    accumulator,
    barrier,
    require_space,
    smem,
    store_tile,
    swizzle_bytes,
    tile_transforms,
    tma_boxes,
    tma_copies_in_place,
    tma_swizzle,
)
from core.smem_budget import SmemBudget, SmemBuffer

__all__ = [
    "GMEM", "REGS", "SMEM", "TMEM", "HOPPER_DEFAULTS", "DeviceFacts", "PipelineOptions",
    "SmemBudget", "SmemBuffer", "accumulator", "barrier", "compiler_params", "device_facts",
    "has_gpu", "interpret_mode", "interpret_params", "is_interpreting", "races_found",
    "require_space", "sequential_grid_semantics", "smem", "store_tile", "swizzle_bytes",
    "tile_transforms",
    "tma_boxes", "tma_copies_in_place", "tma_swizzle",
]
