"""Hopper matmuls: the emit_pipeline kernel, the warp-specialized persistent
kernel (`matmul`), their configs, references and autotuning.

Where things live: `matmul.py` (the public entry), `heuristic.py` (configs
without tuning), `kernel_call.py` (the one wrapper: validation, padding, the
kernel call), `*_sm90.py` (the kernel bodies), `config.py`, `operands.py`,
`epilogue.py`, `reference.py`, `autotune.py` and `tuning_cache.py`;
`gated_linear_unit.py` (the fused gated unit of transformer MLPs);
`ragged_dot.py` and `group_schedule.py` (the grouped matmul of
mixture-of-experts layers); `fp8.py`, `fp8_quantize.py` (blocks, scales and
the XLA reference), `fp8_quantize_sm90.py` (`quantize_fp8`: a tensor quantized
in one or both layouts from one read) and
`fp8_matmul_sm90.py` (the block-scaled FP8 matmul).

The hook contract for kernels built on the cooperative body (the ring
all-gather matmul in `collectives`): `emit_cooperative_matmul` with a
`PipelineCallback` and `delay_release`, inside a `persistent_kernel` (grid
axis `SM_AXIS`, thread axis `WG_AXIS`), its config checked by
`check_ws_config`.
"""

from pipelines.config import Fp8Config, MatmulDimension, PipelinedConfig, Schedule, TuningConfig
from pipelines.cooperative_matmul_sm90 import PipelineCallback, emit_cooperative_matmul
from pipelines.dot_general import dot_general
from pipelines.epilogue import Epilogue
from pipelines.fp8 import fp8_linear, fp8_matmul
from pipelines.fp8_quantize import dequantize_fp8, quantize_fp8_reference
from pipelines.fp8_quantize_sm90 import quantize_fp8, quantize_fp8_both_layouts
from pipelines.gated_linear_unit import gated_linear_unit
from pipelines.heuristic import default_config
from pipelines.kernel_call import (
    check_ws_config,
    persistent_kernel,
    pipelined_matmul,
    ws_matmul,
    ws_smem_budget,
)
from pipelines.matmul import matmul
from pipelines.pallas_call_matmul import pallas_call_matmul
from pipelines.persistent_sm90 import SM_AXIS, WG_AXIS
from pipelines.ragged_dot import ragged_dot
from pipelines.reference import fp8_matmul_reference, matmul_reference

__all__ = [
    "SM_AXIS", "WG_AXIS", "Epilogue", "Fp8Config", "MatmulDimension", "PipelineCallback",
    "PipelinedConfig", "Schedule", "TuningConfig", "check_ws_config", "default_config",
    "dequantize_fp8", "dot_general", "emit_cooperative_matmul", "fp8_linear", "fp8_matmul",
    "fp8_matmul_reference",
    "gated_linear_unit",
    "matmul", "matmul_reference", "pallas_call_matmul", "persistent_kernel", "pipelined_matmul",
    "quantize_fp8", "quantize_fp8_both_layouts", "quantize_fp8_reference", "ragged_dot",
    "ws_matmul", "ws_smem_budget",
]
