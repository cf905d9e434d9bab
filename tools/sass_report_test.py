"""sass_report's reading of ptxas logs and SASS listings (no GPU, no CUDA plugin)."""

from absl.testing import absltest

from pipelines import Fp8Config, Schedule, TuningConfig
from tools import sass_report

# From Mosaic GPU's ptxas log of a kernel whose wgmmas ptxas serialized.
SERIALIZED_LOG = """\
ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are \
serialized due to non wgmma instructions reading accumulator registers of  a wgmma \
between start and end of the pipeline stage in the function 'k_mosaic_gpu_kernel' in line 0
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for k_mosaic_gpu_kernel
    184 bytes stack frame, 316 bytes spill stores, 312 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 184 bytes cumulative stack size
"""
CLEAN_LOG = """\
ptxas info    : (C7519) warpgroup.arrive is injected in around line 750 by compiler to \
allow use of registers in GMMA in function 'k_mosaic_gpu_kernel'
ptxas info    : Function properties for k_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
"""
# Lines of `cuobjdump -sass` output: predicated, with modifiers, and their encodings.
SASS = """\
        /*2d60*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR16], RZ, !UPT ;
                                                                  /* 0x000fe2000c7008ff */
        /*2e90*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*2ea0*/                   LDS R138, [R139] ;
        /*2f10*/                   FFMA R6, R25, R138.reuse, R6 ;
        /*2f20*/                   FFMA R133, R24, R138, R133 ;
        /*3140*/              @!P1 BRA 0x31b0 ;
        /*3170*/              @UP0 UIADD3 UR6, UR5, -0x5, URZ ;
"""

# The entry computation of a grouped matmul's optimized HLO, trimmed: a fusion, a
# multi-output fusion and the Mosaic GPU kernel.
HLO = """\
HloModule jit_fn

%fused_select (p: s32[4,16]) -> s32[61] {
  ROOT %p = s32[4,16]{1,0} parameter(0)
}

ENTRY %main.17 (lhs.1: bf16[16384,2048], group_sizes.1: s32[60]) -> bf16[16384,1408] {
  %group_sizes.1 = s32[60]{0} parameter(1), metadata={op_name="group_sizes"}
  %lhs.1 = bf16[16384,2048]{1,0} parameter(0), metadata={op_name="lhs"}
  %loop_select_fusion = s32[61]{0} fusion(%group_sizes.1), kind=kLoop, calls=%fused_select
  %loop_min_fusion = (s32[193]{0}, s32[193]{0}) fusion(%loop_select_fusion), kind=kLoop
  %get-tuple-element.2 = s32[193]{0} get-tuple-element(%loop_min_fusion), index=0
  ROOT %mpmd_map.1 = bf16[16384,1408]{1,0} custom-call(%lhs.1, %get-tuple-element.2), \
custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI
}
"""


class SassReportTest(absltest.TestCase):

  def test_serialized_wgmmas_and_spills(self):
    info = sass_report.parse_ptxas(SERIALIZED_LOG)
    self.assertEqual((info.registers, info.spill_store_bytes, info.spill_load_bytes,
                      info.serialized_wgmma), (168, 316, 312, True))
    self.assertLen(info.warnings, 1)

  def test_a_clean_kernel(self):
    info = sass_report.parse_ptxas(CLEAN_LOG)
    self.assertEqual((info.registers, info.spill_store_bytes, info.serialized_wgmma, info.warnings),
                     (168, 0, False, ()))

  def test_rejects_what_is_not_a_kernels_log(self):
    with self.assertRaisesRegex(ValueError, "not a ptxas -v log"):
      sass_report.parse_ptxas("ptxas fatal   : Unresolved extern function")

  def test_counts_the_opcodes_of_a_listing_with_control_codes(self):
    listing = """\
   -:-:1:Y:02        /*0000*/                   LDC R1, c[0x0][0x28]
   1:-:-:Y:01        /*0010*/                   VIADD R1, R1, 0xfffffff8
   -:-:-:-:04        /*0070*/              @!P0 STL [R1], R0
"""
    self.assertEqual(dict(sass_report.sass_opcodes(listing)), {"LDC": 1, "VIADD": 1, "STL": 1})

  def test_counts_opcodes_without_modifiers_or_predicates(self):
    self.assertEqual(dict(sass_report.sass_opcodes(SASS)),
                     {"QGMMA": 1, "WARPGROUP": 1, "LDS": 1, "FFMA": 2, "BRA": 1, "UIADD3": 1})

  def test_hlo_shape_bytes(self):
    self.assertEqual(sass_report.hlo_shape_bytes("bf16[8192,4096]{1,0}"), 8192 * 4096 * 2)
    self.assertEqual(sass_report.hlo_shape_bytes("(f32[64,4096]{1,0}, f8e4m3fn[8192,1,32,128])"),
                     64 * 4096 * 4 + 8192 * 32 * 128)
    self.assertEqual(sass_report.hlo_shape_bytes("s32[]"), 4)

  def test_hlo_launches_in_order_with_their_bytes(self):
    launches = sass_report.hlo_launches(HLO)
    self.assertEqual([(x["name"], x["kind"]) for x in launches],
                     [("loop_select_fusion", "fusion"), ("loop_min_fusion", "fusion"),
                      ("mpmd_map.1", "mosaic_gpu_v2")])
    self.assertEqual([(x["operand_bytes"], x["result_bytes"]) for x in launches],
                     [(240, 244), (244, 2 * 193 * 4),
                      (16384 * 2048 * 2 + 193 * 4, 16384 * 1408 * 2)])

  def test_fail_on(self):
    clean = dict(kernel="a", serialized_wgmma=False, spill_store_bytes=0)
    spilling = dict(kernel="b", serialized_wgmma=False, spill_store_bytes=12)
    serialized = dict(kernel="c", serialized_wgmma=True, spill_store_bytes=0)
    reports = [clean, spilling, serialized]
    self.assertEqual(sass_report.failed_kernels(reports, set()), [])
    self.assertEqual(len(sass_report.failed_kernels(reports, {"serialized"})), 1)
    self.assertEqual(len(sass_report.failed_kernels(reports, {"serialized", "spills"})), 2)
    with self.assertRaises(SystemExit):
      sass_report.main(["--op=matmul", "--shapes=8x8x8", "--fail_on=slow"])

  def test_arguments(self):
    """Shapes and the config are parsed before anything compiles, enums by name."""
    self.assertEqual(sass_report.parse_request("matmul", "8192x4096X14336", ""),
                     ([(8192, 4096, 14336)], None))
    self.assertEqual(sass_report.parse_request("matmul", "8x8x8",
                                               "tile_m=128,tile_n=192,schedule=PINGPONG")[1],
                     TuningConfig(tile_m=128, tile_n=192, schedule=Schedule.PINGPONG))
    self.assertEqual(sass_report.parse_request("fp8_matmul", "8x8x8", "k_blocks_per_step=2,"
                                               "max_concurrent_steps=2")[1],
                     Fp8Config(k_blocks_per_step=2, max_concurrent_steps=2))
    self.assertIsNone(sass_report.parse_request("fp8_linear_step", "8x8x8", "")[1])
    self.assertEqual(sass_report.parse_request("gated_linear_unit", "8x8x8", "tile_m=64")[1],
                     TuningConfig(tile_m=64))
    with self.assertRaisesRegex(ValueError, "shape '4096x4096' must be 3 positive integers"):
      sass_report.main(["--op=matmul", "--shapes=4096x4096"])
    with self.assertRaisesRegex(ValueError, "TuningConfig has no field 'tile_q'"):
      sass_report.main(["--op=matmul", "--shapes=8x8x8", "--config=tile_q=3"])


if __name__ == "__main__":
  absltest.main()
