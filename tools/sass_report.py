"""What ptxas makes of our kernels, on a machine without a GPU.

    python tools/sass_report.py --op=fp8_matmul --shapes=1024x1024x1024 \\
        --config=k_blocks_per_step=2,max_concurrent_steps=2

Compiles an op for sm_90a through XLA's compile-only path for a GPU that is not
there (`jax.experimental.topologies`, with an H100's target description), so that
Mosaic GPU lowers each kernel and runs ptxas as it would on the GPU machine, and
lists the SASS of what it built (with nvdisasm). Reports, per
kernel: the registers, spill bytes, ptxas's warning that it serialized the wgmmas
(C7514: an instruction reads an accumulator whose wgmmas may still run, so every
wgmma is waited for), and how many of each SASS instruction the kernel has (the
tensor-core ones: HGMMA for 16-bit operands, QGMMA for e4m3; their waits,
WARPGROUP.DEPBAR; FFMA). And, per call, the XLA kernels that run beside ours (the
optimized HLO's fusions) with the bytes each reads and writes. That answers, without a
GPU, whether a kernel change keeps its wgmmas in flight and its registers out of local
memory, and what a call moves outside its kernels; speed still needs a GPU.
`--op=fp8_linear_step` is `fp8_linear`'s forward and backward (x (M, K), w (K, N)).
`--fail_on=serialized,spills` makes it a check: exit 1 where any kernel has either.

Needs Python 3.12 with jax[cuda13] and cuobjdump, in an environment of its own
(about 4.5 GB of CUDA libraries), with this repository on PYTHONPATH:

    python3.12 -m venv /tmp/sass-env
    /tmp/sass-env/bin/pip install -r tools/sass_requirements.txt
    PYTHONPATH=. /tmp/sass-env/bin/python tools/sass_report.py --op=matmul --shapes=8192x4096x14336

Writes `sass_report.json`, and each call's optimized HLO and each kernel's PTX, ptxas log
and SASS, to `--out_dir`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from tools import cli

# An H100 SXM as XLA describes a GPU it compiles for without one (XLA's
# gpu_specs/h100_sxm.txtpb). sm_90a code is the same for an H200; only
# memory sizes and bandwidth differ.
H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84978434048
  shared_memory_per_block_optin: 232448 cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
"""
# ptxas's note that it waits for every wgmma of the kernel.
SERIALIZED_WGMMA = "C7514"
OPS = ("matmul", "gated_linear_unit", "ragged_dot", "fp8_matmul", "fp8_linear_step")
# Bytes of one element of each HLO element type a report may meet.
_HLO_ITEMSIZE = dict(pred=1, s8=1, u8=1, f8e4m3fn=1, f8e5m2=1, bf16=2, f16=2, s32=4, u32=4,
                     f32=4, s64=8, f64=8)


@dataclasses.dataclass(frozen=True)
class PtxasInfo:
  """What `ptxas -v` said about one kernel."""

  registers: int
  spill_store_bytes: int
  spill_load_bytes: int
  serialized_wgmma: bool
  warnings: tuple[str, ...]


def parse_ptxas(log: str) -> PtxasInfo:
  """The registers, spills and warnings of a `ptxas -v` log of one kernel."""
  registers = re.search(r"Used (\d+) registers", log)
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
  if registers is None or spills is None:
    raise ValueError(f"not a ptxas -v log of a kernel:\n{log}")
  warnings = tuple(line.strip() for line in log.splitlines()
                   if "Performance Loss" in line or "ptxas warning" in line)
  return PtxasInfo(registers=int(registers[1]), spill_store_bytes=int(spills[1]),
                   spill_load_bytes=int(spills[2]), serialized_wgmma=SERIALIZED_WGMMA in log,
                   warnings=warnings)


# An instruction line of `cuobjdump -sass`, or of nvdisasm's listing with each
# instruction's control codes before it ("-:-:1:Y:02").
_SASS_INSTRUCTION = re.compile(
    r"^\s*(?:[-\d]+:[-\d]+:[-\d]+:[-YN]:\d+\s+)?/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?"
    r"([A-Z][A-Z0-9_]*)")


def sass_opcodes(sass: str) -> collections.Counter:
  """How many of each instruction (the opcode without its modifiers: QGMMA,
  WARPGROUP, FFMA) a `cuobjdump -sass` listing has."""
  counts = collections.Counter()
  for line in sass.splitlines():
    match = _SASS_INSTRUCTION.match(line)
    if match:
      counts[match[1]] += 1
  return counts


def hlo_shape_bytes(shape: str) -> int:
  """The bytes of an HLO shape, `bf16[8192,4096]{1,0}` or a tuple of them."""
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", shape):
    if dtype in _HLO_ITEMSIZE:
      total += _HLO_ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def hlo_launches(hlo: str) -> list[dict]:
  """The kernels of an optimized HLO module's entry computation, in order: each
  fusion and custom call (a Mosaic GPU kernel is `mosaic_gpu_v2`), with the
  bytes of its operands and of its result, from their shapes."""
  entry = hlo[hlo.index("ENTRY"):]
  shapes = dict(re.findall(r"%([\w.\-]+) = (\(.*?\)|\S+) ", entry))
  launches = []
  for name, shape, kind, operands in re.findall(
      r"%([\w.\-]+) = (\(.*?\)|\S+) (fusion|custom-call)\((.*?)\)", entry):
    target = re.search(r"%" + re.escape(name) + r" = .*?custom_call_target=\"([\w.]+)\"", entry)
    launches.append(dict(
        name=name, kind=target[1] if kind == "custom-call" and target else kind,
        operand_bytes=sum(hlo_shape_bytes(shapes.get(arg, ""))
                          for arg in re.findall(r"%([\w.\-]+)", operands)),
        result_bytes=hlo_shape_bytes(shape)))
  return launches


def parse_request(op: str, shapes: str, config: str) -> tuple[list[tuple[int, ...]], object]:
  """The problems ("MxKxN,...") and the config ("field=value,...") of a run of
  `op`, parsed before anything compiles: a `TuningConfig` for matmul and
  ragged_dot, or an `Fp8Config` for the FP8 ops (None for none: the op's
  default for each problem). Raises ValueError naming a bad shape or field."""
  from pipelines import Fp8Config, TuningConfig
  problems = [cli.parse_shape(text) for text in shapes.split(",")]
  config_type = TuningConfig if op in ("matmul", "gated_linear_unit", "ragged_dot") else Fp8Config
  return problems, cli.parse_config(config_type, config) if config else None


def _compile_op(op: str, shape: tuple[int, ...], *, groups: int, config,
                transpose_lhs: bool, transpose_rhs: bool) -> str:
  """Traces and compiles `op` at `shape` (bf16; e4m3 for fp8_matmul) with
  `config` (`parse_request`'s) for the compile-only H100 device, where Mosaic
  GPU runs ptxas on each of its kernels; returns the optimized HLO.
  `fp8_linear_step` is `fp8_linear`'s forward and backward, x (M, K), w (K, N)
  and the cotangent bf16."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import topologies
  from jax.sharding import SingleDeviceSharding

  import pipelines
  from pipelines.fp8_quantize import ROW_BLOCK, SQUARE_BLOCK, scales_shape

  topology = topologies.get_topology_desc("sass_report", "cuda", target_config=H100_TARGET,
                                          topology="1x1x1")
  sharding = SingleDeviceSharding(topology.devices[0])

  def spec(dims, dtype):
    return jax.ShapeDtypeStruct(dims, dtype, sharding=sharding)

  m, k, n = shape
  bf16 = jnp.bfloat16
  if op == "matmul":
    def fn(lhs, rhs):
      return pipelines.matmul(lhs, rhs, transpose_lhs=transpose_lhs,
                              transpose_rhs=transpose_rhs, config=config)
    args = (spec((k, m) if transpose_lhs else (m, k), bf16),
            spec((n, k) if transpose_rhs else (k, n), bf16))
  elif op == "gated_linear_unit":
    def fn(x, w_gate, w_up):
      return pipelines.gated_linear_unit(x, w_gate, w_up, transpose_rhs=transpose_rhs,
                                         config=config)
    args = (spec((m, k), bf16), *[spec((n, k) if transpose_rhs else (k, n), bf16)] * 2)
  elif op == "ragged_dot":
    def fn(lhs, rhs, group_sizes):
      return pipelines.ragged_dot(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                                  config=config)
    args = (spec((m, k), bf16), spec((groups, n, k) if transpose_rhs else (groups, k, n), bf16),
            spec((groups,), jnp.int32))
  elif op == "fp8_matmul":
    def fn(lhs, rhs, lhs_scales, rhs_scales):
      return pipelines.fp8_matmul(lhs, rhs, lhs_scales, rhs_scales, config=config)
    args = (spec((m, k), jnp.float8_e4m3fn), spec((n, k), jnp.float8_e4m3fn),
            spec(scales_shape((m, k), ROW_BLOCK), jnp.float32),
            spec(scales_shape((n, k), SQUARE_BLOCK), jnp.float32))
  else:
    def fn(x, w, cotangent):
      out, vjp = jax.vjp(lambda x, w: pipelines.fp8_linear(x, w, config=config), x, w)
      return out, *vjp(cotangent)
    args = (spec((m, k), bf16), spec((k, n), bf16), spec((m, n), bf16))
  return jax.jit(fn).lower(*args).compile().as_text()


def _cuda_tool(name: str) -> str:
  """The path of `name` (ptxas, cuobjdump) in the nvidia wheels of this Python."""
  import nvidia
  for root in nvidia.__path__:
    for path in Path(root).glob(f"*/bin/{name}"):
      return str(path)
  raise FileNotFoundError(f"{name} is not in the nvidia wheels of {sys.executable}: "
                          "install tools/sass_requirements.txt")


def kernel_reports(dump_dir: Path) -> list[dict]:
  """Each kernel Mosaic GPU dumped into `dump_dir`: the report of its own ptxas
  run (`<kernel>.ptxas`) and the instruction counts of its SASS: Mosaic GPU's
  own listing of the binary it built (`<kernel>.sass_ctrl`), or where there is
  none, its PTX assembled again for sm_90a and disassembled (which need not be
  the same code: ptxas's options may differ)."""
  reports = []
  for ptx in sorted(dump_dir.glob("*.ptx")):
    listing = ptx.with_suffix(".sass_ctrl")
    if listing.exists():
      sass = listing.read_text()
    else:
      cubin = ptx.with_suffix(".cubin")
      subprocess.run([_cuda_tool("ptxas"), "-arch=sm_90a", "-o", str(cubin), str(ptx)],
                     check=True, capture_output=True)
      sass = subprocess.run([_cuda_tool("cuobjdump"), "-sass", str(cubin)], check=True,
                            capture_output=True, text=True,
                            env=dict(os.environ, NVDISASM_PATH=_cuda_tool("nvdisasm"))).stdout
      ptx.with_suffix(".sass").write_text(sass)
    info = parse_ptxas(ptx.with_suffix(".ptxas").read_text())
    opcodes = sass_opcodes(sass)
    reports.append(dict(kernel=ptx.stem, **dataclasses.asdict(info),
                        instructions=dict(opcodes.most_common())))
  return reports


def main(argv: list[str]) -> int:
  import argparse
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--op", choices=OPS, required=True)
  parser.add_argument("--shapes", required=True, help="MxKxN,...")
  parser.add_argument("--groups", type=int, default=8, help="ragged_dot's G.")
  parser.add_argument("--config", default="",
                      help="field=value,... of TuningConfig (matmul, ragged_dot; enums by "
                           "name, schedule=PINGPONG; default: the heuristic's) or Fp8Config "
                           "(fp8_matmul, fp8_linear_step)")
  parser.add_argument("--transpose_lhs", action="store_true")
  parser.add_argument("--transpose_rhs", action="store_true")
  parser.add_argument("--out_dir", default="sass_report")
  parser.add_argument("--fail_on", default="",
                      help="serialized,spills: exit 1 if any kernel has serialized wgmmas or "
                           "spills registers (a check before landing a kernel change)")
  args = parser.parse_args(argv)
  fail_on = set(filter(None, args.fail_on.split(",")))
  if not fail_on <= {"serialized", "spills"}:
    parser.error(f"--fail_on={args.fail_on!r}: must name serialized and/or spills")
  problems, config = parse_request(args.op, args.shapes, args.config)

  out_dir = Path(args.out_dir).resolve()
  # Before jax starts: no GPU to check the CUDA libraries against, kernels
  # compiled for the GPU (not interpreted), and every kernel's PTX and ptxas
  # log written to the folder `MOSAIC_GPU_DUMP_TO` names.
  os.environ.update(JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", MGPU_INTERPRET="0",
                    MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1")
  results = []
  for text, shape in zip(args.shapes.split(","), problems, strict=True):
    dump_dir = out_dir / f"{args.op}_{text}"
    dump_dir.mkdir(parents=True, exist_ok=True)
    os.environ["MOSAIC_GPU_DUMP_TO"] = str(dump_dir)
    hlo = _compile_op(args.op, shape, groups=args.groups, config=config,
                      transpose_lhs=args.transpose_lhs, transpose_rhs=args.transpose_rhs)
    (dump_dir / "optimized_hlo.txt").write_text(hlo)
    # Mosaic GPU's log of every MLIR pass, tens of MB a kernel, is not read here.
    for log in dump_dir.glob("*.mlir-passes.log"):
      log.unlink()
    launches = hlo_launches(hlo)
    results.append(dict(op=args.op, shape=text, launches=launches))
    others = [launch for launch in launches if launch["kind"] != "mosaic_gpu_v2"]
    print(f"{args.op} {text}: {len(launches) - len(others)} Mosaic GPU kernels and "
          f"{len(others)} XLA kernels, which read and write "
          f"{sum(x['operand_bytes'] + x['result_bytes'] for x in others) / 1e6:.0f} MB")
    for report in kernel_reports(dump_dir):
      results.append(dict(op=args.op, shape=text, **report))
      counts = report["instructions"]
      print(f"{args.op} {text} {report['kernel']}: {report['registers']} registers, "
            f"spills {report['spill_store_bytes']}/{report['spill_load_bytes']} bytes, "
            f"wgmmas {'SERIALIZED' if report['serialized_wgmma'] else 'in flight'}; "
            + ", ".join(f"{op} {counts.get(op, 0)}" for op in
                        ("HGMMA", "QGMMA", "WARPGROUP", "FFMA", "STL", "LDL")))
  (out_dir / "sass_report.json").write_text(json.dumps(results, indent=1))
  failures = failed_kernels([r for r in results if "kernel" in r], fail_on)
  for failure in failures:
    print(f"FAILED: {failure}")
  return 1 if failures else 0


def failed_kernels(reports: list[dict], fail_on: set[str]) -> list[str]:
  """The kernels of `reports` (`kernel_reports`' rows) that `--fail_on` rejects."""
  failures = []
  for report in reports:
    name = f"{report.get('op', '')} {report.get('shape', '')} {report['kernel']}".strip()
    if "serialized" in fail_on and report["serialized_wgmma"]:
      failures.append(f"{name}: ptxas serialized its wgmmas ({SERIALIZED_WGMMA})")
    if "spills" in fail_on and report["spill_store_bytes"]:
      failures.append(f"{name}: {report['spill_store_bytes']} bytes of registers spilled")
  return failures


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
