"""Hopper matmuls: the emit_pipeline kernel, the warp-specialized persistent
kernel (`matmul`), their configs, references and autotuning."""

from pipelines.config import MatmulDimension, PipelinedConfig, Schedule, TuningConfig
from pipelines.epilogue import Epilogue
from pipelines.matmul import default_config, matmul
from pipelines.pallas_call_matmul import pallas_call_matmul
from pipelines.pipelined_matmul import pipelined_matmul
from pipelines.reference import matmul_reference
from pipelines.ws_matmul_sm90 import emit_ws_matmul, ws_matmul

__all__ = [
    "Epilogue", "MatmulDimension", "PipelinedConfig", "Schedule", "TuningConfig", "default_config",
    "emit_ws_matmul", "matmul", "matmul_reference", "pallas_call_matmul", "pipelined_matmul",
    "ws_matmul",
]
