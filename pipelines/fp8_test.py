"""FP8 quantization and the block-scaled `fp8_matmul`, in interpret mode and on a GPU."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import simulator
from core import testing
from core.numerics import RELATIVE_TOLERANCE, relative_error
from pipelines import (
  Epilogue,
  Fp8Config,
  dequantize_fp8,
  fp8_linear,
  fp8_matmul,
  fp8_matmul_reference,
  quantize_fp8,
  quantize_fp8_both_layouts,
  quantize_fp8_reference,
)
from pipelines import matmul_test_base as base
from pipelines.fp8 import default_config as fp8_default_config
from pipelines.fp8_quantize import (
    E4M3_MAX,
    ROW_BLOCK,
    SQUARE_BLOCK,
    block_scales,
    scales_shape,
)

# The persistent kernel's three warpgroups wait on each other's barriers, each
# on a thread of XLA's intra-op pool: a pool of two (a 2-core machine) can
# deadlock (`simulator.thread_pool`).
simulator.reserve_intra_op_threads()

# e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2**-4
# of itself, a subnormal one by half the smallest step, 2**-10 of the scale.
E4M3_RELATIVE_ROUNDING = 2.0**-4
E4M3_SUBNORMAL_ROUNDING = 2.0**-10
# The element-wise bound of `fp8_matmul` against the float32 product of the
# dequantized operands: each element within this fraction of the sum of its
# products' magnitudes (Hopper's tensor cores sum a block's FP8 products with
# about 14 bits; the kernel adds the blocks in float32), plus the output's
# rounding. Measured on an H200: at most 3.0e-4 (2**-11.7) at K = 128, less at
# longer K, over 1024x1024 outputs (docs/performance-log.md, "FP8 on the H200").
# The gated activations move an error by at most 1.13x.
SUM_OF_MAGNITUDES_BOUND = 2.0**-10
ACTIVATION_SLOPE_BOUND = 1.13
# The norm-wise bound of the same comparison, for outputs whose own tolerance
# is tighter (float32): 1.3e-4 to 2.4e-4 measured on the H200, whatever K.
FP8_ACCUMULATION_TOLERANCE = 1e-3
# A layer's output and gradients against the float32 layer: two e4m3
# roundings of 2**-4 at most, averaging to a few percent norm-wise.
FP8_LAYER_TOLERANCE = 0.06
OUTPUT_ROUNDING = {jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11,
                   jnp.dtype(jnp.float32): 2.0**-23}


def quantized_operands(seed: int, m: int, k: int, n: int, rhs_block=SQUARE_BLOCK):
  """(lhs (M, K), rhs (N, K)) e4m3 and their block scales, quantized from
  random normal data whose magnitude varies by 2**4 between elements and by
  2**8 between blocks, so that every block's own scale matters (and a
  float16 output does not overflow); the RHS in `rhs_block`s, its
  magnitudes varying between those blocks."""
  def spread(seed, shape, octaves=2):
    exponents = jax.random.randint(jax.random.key(seed + 100), shape, -octaves, octaves + 1)
    return testing.random_array(seed, shape, jnp.float32) * jnp.exp2(exponents)

  block_factors = spread(seed + 2, (m, -(-k // 128)), octaves=4) / 64
  lhs = spread(seed, (m, k)) * jnp.repeat(block_factors, 128, axis=1)[:, :k]
  rhs_factors = spread(seed + 3, scales_shape((n, k), rhs_block), octaves=4)
  rhs_factors = jnp.repeat(jnp.repeat(rhs_factors, rhs_block[0], 0), rhs_block[1], 1)
  rhs = spread(seed + 1, (n, k)) * rhs_factors[:n, :k]
  return (*quantize_fp8_reference(lhs, ROW_BLOCK), *quantize_fp8_reference(rhs, rhs_block))


def accumulation_bound(lhs, rhs, lhs_scales, rhs_scales, rhs_block=SQUARE_BLOCK) -> np.ndarray:
  """Each output element's bound from the kernel's summation (before the
  output's rounding): `SUM_OF_MAGNITUDES_BOUND` of the sum of its products'
  magnitudes, times the steepest activation's slope."""
  magnitudes = jnp.dot(jnp.abs(dequantize_fp8(lhs, lhs_scales, ROW_BLOCK)),
                       jnp.abs(dequantize_fp8(rhs, rhs_scales, rhs_block)).T,
                       precision=jax.lax.Precision.HIGHEST)
  return ACTIVATION_SLOPE_BOUND * SUM_OF_MAGNITUDES_BOUND * np.asarray(magnitudes)


def row_block_max(x: np.ndarray) -> np.ndarray:
  """The largest element of each (1, 128) block of x (M, N): (M, ceil(N / 128))."""
  m, n = x.shape
  return np.pad(x, ((0, 0), (0, -n % 128)), constant_values=-np.inf).reshape(m, -1, 128).max(2)


def assert_product_close(test, out, ref, out_dtype, accumulation: np.ndarray) -> None:
  """`out` (M, N) of `out_dtype` against the float32 `ref`: norm-wise as
  every kernel (with the FP8 accumulation's floor), and each element within
  its `accumulation` bound plus the output's rounding (a bound on the sum of
  magnitudes, which does not grow with K as one relative to |ref| would).
  The rounding is relative down to the output dtype's subnormals, where it
  is half their step (float16's: 3e-8, which gelu's tails reach)."""
  test.assertEqual((out.shape, out.dtype), (ref.shape, jnp.dtype(out_dtype)))
  test.assert_close(out, ref, dtype=out_dtype,
                    tolerance=max(RELATIVE_TOLERANCE[jnp.dtype(out_dtype)],
                                  FP8_ACCUMULATION_TOLERANCE))
  bound = (accumulation + OUTPUT_ROUNDING[jnp.dtype(out_dtype)] * np.abs(np.asarray(ref))
           + float(jnp.finfo(out_dtype).smallest_subnormal) / 2)
  error = np.abs(np.asarray(out, np.float32) - np.asarray(ref))
  test.assertTrue(np.all(error <= bound),
                  f"{np.count_nonzero(~(error <= bound))} of {error.size} elements outside the "
                  f"bound; worst excess {np.nanmax(error - bound):.3g}")


# `quantize_fp8` (a kernel for 16-bit tensors) and its XLA reference, which
# the tests of both take as the reference.
QUANTIZERS = (("kernel", quantize_fp8), ("xla", quantize_fp8_reference))


class QuantizeTest(testing.KernelTestCase):
  """What quantizing promises, of `quantize_fp8` and of `quantize_fp8_reference`."""

  @parameterized.product(block=[ROW_BLOCK, SQUARE_BLOCK],
                         dtype=[jnp.float32, jnp.bfloat16, jnp.float16],
                         shape=[(256, 384), (130, 300)], quantizer=QUANTIZERS)
  def test_round_trip_within_e4m3_rounding(self, block, dtype, shape, quantizer):
    x = testing.random_array(1, shape, dtype, scale=3.0)
    values, scales = self.run_kernel(functools.partial(quantizer[1], block=block), x)
    self.assertEqual((values.dtype, values.shape), (jnp.dtype(jnp.float8_e4m3fn), shape))
    self.assertEqual((scales.dtype, scales.shape),
                     (jnp.dtype(jnp.float32), scales_shape(shape, block)))
    x32 = np.asarray(x, np.float32)
    scale_of_each = np.asarray(dequantize_fp8(jnp.ones(shape, jnp.float8_e4m3fn), scales, block))
    bound = E4M3_RELATIVE_ROUNDING * np.abs(x32) + E4M3_SUBNORMAL_ROUNDING * scale_of_each
    error = np.abs(np.asarray(dequantize_fp8(values, scales, block)) - x32)
    self.assertTrue(np.all(error <= bound), f"worst excess {np.max(error - bound):.3g}")

  @parameterized.parameters(*QUANTIZERS)
  def test_each_block_scales_to_its_own_largest(self, _, quantize):
    """A block's largest magnitude becomes 448; an outlier moves only its own
    block's scale; a block of zeros gets scale 1."""
    x = testing.random_array(2, (256, 256), jnp.bfloat16)
    x = x.at[3, 7].set(1e4).at[128:, 128:].set(0.0)
    values, scales = self.run_kernel(functools.partial(quantize, block=SQUARE_BLOCK), x)
    amax = np.abs(np.asarray(x, np.float32)).reshape(2, 128, 2, 128).max(axis=(1, 3))
    np.testing.assert_allclose(np.asarray(scales), np.where(amax > 0, amax / E4M3_MAX, 1.0),
                               rtol=1e-6)
    self.assertEqual(float(jnp.max(jnp.abs(values[:128, :128].astype(jnp.float32)))), E4M3_MAX)
    self.assertFalse(bool(jnp.any(values[128:, 128:].astype(jnp.float32) != 0)))
    _, row_scales = self.run_kernel(functools.partial(quantize, block=ROW_BLOCK), x)
    self.assertAlmostEqual(float(row_scales[3, 0]), float(x[3, 7]) / E4M3_MAX, places=4)
    self.assertLess(float(row_scales[4, 0]), 1.0)

  def test_block_scales_of_non_finite_blocks(self):
    """A block whose largest magnitude is NaN gets scale NaN, not 1 (its other
    elements would be rounded unscaled); inf gets inf: both dequantize to NaN."""
    scales = np.asarray(block_scales(jnp.array([jnp.nan, jnp.inf, 0.0, E4M3_MAX])))
    np.testing.assert_array_equal(scales, [np.nan, np.inf, 1.0, 1.0])

  @parameterized.product(block=[ROW_BLOCK, SQUARE_BLOCK], quantizer=QUANTIZERS)
  def test_a_non_finite_element(self, block, quantizer):
    """It dequantizes to NaN, an inf's block whole; no other block changes."""
    quantize = functools.partial(quantizer[1], block=block)
    x = testing.random_array(3, (256, 256), jnp.bfloat16)
    poisoned = x.at[3, 7].set(jnp.nan).at[200, 150].set(jnp.inf)
    got = np.asarray(dequantize_fp8(*self.run_kernel(quantize, poisoned), block))
    want = np.asarray(dequantize_fp8(*quantize_fp8_reference(x, block), block))
    inf_rows = 200 // block[0] * block[0]
    self.assertTrue(np.isnan(got[3, 7]))
    self.assertTrue(np.all(np.isnan(got[inf_rows:inf_rows + block[0], 128:256])))
    assert_clean_blocks_equal(self, got, want, [(3, 7), (200, 150)], block)

  @parameterized.parameters(*QUANTIZERS)
  def test_errors(self, _, quantize):
    with self.assertRaisesRegex(ValueError, r"block=\(64, 64\) must be one of"):
      quantize(jnp.ones((4, 4), jnp.bfloat16), (64, 64))
    with self.assertRaisesRegex(ValueError, "x must be 2-D"):
      quantize(jnp.ones((2, 4, 4), jnp.bfloat16))
    with self.assertRaisesRegex(ValueError, "x.dtype=int32 must be one of"):
      quantize(jnp.ones((4, 4), jnp.int32))

  def test_dequantize_errors(self):
    values, scales = quantize_fp8_reference(jnp.ones((100, 256)))
    with self.assertRaisesRegex(ValueError, r"scales must have shape \(100, 2\) .* got \(300, 2\)"):
      dequantize_fp8(values, jnp.ones((300, 2)))
    with self.assertRaisesRegex(ValueError, r"scales must have shape \(100, 2\) .* got \(2, 100\)"):
      dequantize_fp8(values, scales.T)
    with self.assertRaisesRegex(ValueError, r"values must be 2-D \(R, C\) float8_e4m3fn, got "
                                r"\(100, 256\) bfloat16"):
      dequantize_fp8(values.astype(jnp.bfloat16), scales)


def assert_clean_blocks_equal(test, got, want, poisoned, block) -> None:
  """`got` equals `want` in every `block` that holds none of the `poisoned`
  (row, column) elements (at least one block does)."""
  clean = np.ones(got.shape, bool)
  for row, col in poisoned:
    rows, cols = row // block[0] * block[0], col // block[1] * block[1]
    clean[rows:rows + block[0], cols:cols + block[1]] = False
  test.assertTrue(clean.any())
  np.testing.assert_array_equal(got[clean], want[clean])


def assert_bitwise_equal(test, got, want, what, *, zero_sign_may_differ=False):
  """The same shape, dtype and bits; with `zero_sign_may_differ`, a zero of
  `want` may be a zero of the other sign in `got`."""
  test.assertEqual((got.shape, got.dtype), (want.shape, want.dtype), what)
  bits = np.dtype(f"uint{jnp.dtype(got.dtype).itemsize * 8}")
  got_bits, want_bits = np.asarray(got).view(bits), np.asarray(want).view(bits)
  if zero_sign_may_differ:
    zero = ((np.asarray(want).astype(np.float32) == 0)
            & (np.asarray(got).astype(np.float32) == 0))
    want_bits, got_bits = np.where(zero, 0, want_bits), np.where(zero, 0, got_bits)
  mismatched = int(np.sum(got_bits != want_bits))
  test.assertEqual(mismatched, 0, f"{what}: {mismatched} elements differ")


class QuantizeBothLayoutsTest(testing.KernelTestCase):
  """`quantize_fp8_both_layouts`, and `quantize_fp8` with and without
  `transpose`, are XLA's `quantize_fp8_reference` of x and of x.T, bit for
  bit but for the sign of x's zeros in x.T's layout."""

  def check(self, shape, block, dtype, x=None):
    # Rows of magnitudes 2**-6 to 2**6 (apart by more than a block's
    # range of e4m3), so a row's or a column's scale taken from the wrong
    # place shows.
    if x is None:
      x = (testing.random_array(11, shape, jnp.float32)
           * jnp.exp2(jnp.round(testing.random_array(12, (shape[0], 1), jnp.float32) * 3))
           ).astype(dtype)
    (values, scales), (values_t, scales_t) = self.run_kernel(
        functools.partial(quantize_fp8_both_layouts, block=block), x)
    one_layout = [self.run_kernel(functools.partial(quantize_fp8, block=block,
                                                    transpose=transpose), x)
                  for transpose in (False, True)]
    for what, got, want in zip(("values", "scales", "values of x.T", "scales of x.T") * 2,
                               (values, scales, values_t, scales_t, *one_layout[0],
                                *one_layout[1]),
                               (*quantize_fp8_reference(x, block),
                                *quantize_fp8_reference(x.T, block)) * 2,
                               strict=True):
      # x.T's values are products of the identity, whose sums of zeros are +0.
      assert_bitwise_equal(self, got, want, what, zero_sign_may_differ=what == "values of x.T")

  @parameterized.product(block=[ROW_BLOCK, SQUARE_BLOCK],
                         shape=[(256, 384), (200, 136)])
  def test_each_layout_is_xlas(self, block, shape):
    """Aligned, and padded to whole tiles (the pads cut off)."""
    self.check(shape, block, jnp.bfloat16)

  @parameterized.parameters(jnp.float16, jnp.float32)
  def test_other_dtypes(self, dtype):
    """float16 through the kernel; float32 through `quantize_fp8_reference`
    (the tensor cores would round it to tf32)."""
    self.check((128, 256), ROW_BLOCK, dtype)

  @parameterized.parameters((ROW_BLOCK,), (SQUARE_BLOCK,))
  def test_zeros_and_rounding_ties(self, block):
    """Signed zeros, whole zero rows and columns (scale 1), and multiples of
    16 whose quotients by their scales fall on e4m3's rounding ties: the
    reciprocal's product must round as XLA's division does."""
    x = np.array(testing.random_array(14, (256, 384), jnp.float32))
    x = np.round(x * 8) * 16
    x[::7] = 0.0
    x[:, ::5] = -0.0
    self.check(x.shape, block, jnp.bfloat16, x=jnp.asarray(x, jnp.bfloat16))

  @parameterized.parameters((ROW_BLOCK,), (SQUARE_BLOCK,))
  def test_a_non_finite_element(self, block):
    """In x's layout as in XLA's. In x.T's, the identity's zeros times a
    non-finite x[r, c] are NaN at (c2, r) for each c2 of the 64 columns of
    x's tile half that holds c: those elements, not (c, r) alone, dequantize
    to NaN; blocks without one are XLA's."""
    x = testing.random_array(15, (256, 384), jnp.bfloat16)
    poisoned = x.at[3, 70].set(jnp.nan).at[200, 300].set(jnp.inf)
    (values, scales), (values_t, scales_t) = self.run_kernel(
        functools.partial(quantize_fp8_both_layouts, block=block), poisoned)

    def dequantized(values, scales):
      return np.asarray(dequantize_fp8(values, scales, block))
    got, got_t = dequantized(values, scales), dequantized(values_t, scales_t)
    self.assertTrue(np.isnan(got[3, 70]) and np.isnan(got[200, 300]))
    assert_clean_blocks_equal(self, got, dequantized(*quantize_fp8_reference(x, block)),
                              [(3, 70), (200, 300)], block)
    spread = [(c, 3) for c in range(64, 128)] + [(c, 200) for c in range(256, 320)]
    self.assertTrue(all(np.isnan(got_t[index]) for index in spread))
    assert_clean_blocks_equal(self, got_t, dequantized(*quantize_fp8_reference(x.T, block)),
                              spread, block)

  @parameterized.parameters((ROW_BLOCK,), (SQUARE_BLOCK,))
  def test_lowers_for_the_gpu(self, block):
    """Mosaic GPU's checks (the identity's and the transposed tile's wgmma
    operands, the e4m3 stores, the TMA copies), for CUDA (a CPU lowers too)."""
    x = testing.random_array(13, (256, 384), jnp.bfloat16)
    for quantize in (functools.partial(quantize_fp8_both_layouts, block=block),
                     functools.partial(quantize_fp8, block=block),
                     functools.partial(quantize_fp8, block=block, transpose=True)):
      text = testing.lowered_for_gpu(quantize, x)
      self.assertEqual(testing.mosaic_kernel_count(text), 1)

  def test_empty(self):
    (values, scales), (values_t, scales_t) = quantize_fp8_both_layouts(
        jnp.ones((0, 256), jnp.bfloat16))
    self.assertEqual((values.shape, scales.shape, values_t.shape, scales_t.shape),
                     ((0, 256), (0, 2), (256, 0), (256, 0)))
    values_t, scales_t = quantize_fp8(jnp.ones((0, 256), jnp.bfloat16), transpose=True)
    self.assertEqual((values_t.shape, scales_t.shape), ((256, 0), (256, 0)))

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, r"block=\(64, 64\) must be one of"):
      quantize_fp8_both_layouts(jnp.ones((4, 4), jnp.bfloat16), (64, 64))
    with self.assertRaisesRegex(ValueError, "x must be 2-D"):
      quantize_fp8_both_layouts(jnp.ones((2, 4, 4), jnp.bfloat16))
    with self.assertRaisesRegex(ValueError, "x.dtype=int32 must be one of"):
      quantize_fp8_both_layouts(jnp.ones((4, 4), jnp.int32))
    with self.assertRaisesRegex(ValueError, r"block=\(1, 64\) must be one of"):
      quantize_fp8(jnp.ones((4, 4), jnp.bfloat16), (1, 64), transpose=True)
    with self.assertRaisesRegex(ValueError, "x must be 2-D"):
      quantize_fp8(jnp.ones((4,), jnp.bfloat16))


class Fp8MatmulTest(testing.KernelTestCase):
  """The cases of `fp8_matmul`, on its one-warpgroup kernel (the subclass
  below runs them on the warp-specialized one, the default)."""

  config = Fp8Config(compute_wgs=1)

  def check(self, m, k, n, *, seed, out_dtype=jnp.bfloat16, epilogue=Epilogue(), config=None,
            rhs_block=SQUARE_BLOCK):
    config = self.config if config is None else config
    lhs, lhs_scales, rhs, rhs_scales = quantized_operands(seed, m, k, n, rhs_block)
    bias = testing.random_array(seed + 3, (n,), jnp.float32) if epilogue.has_bias else None
    out = self.run_kernel(fp8_matmul, lhs, rhs, lhs_scales, rhs_scales, bias,
                          activation=epilogue.activation, out_dtype=out_dtype, config=config)
    ref = fp8_matmul_reference(lhs, rhs, lhs_scales, rhs_scales, bias, epilogue=epilogue)
    assert_product_close(self, out, ref, out_dtype,
                         accumulation_bound(lhs, rhs, lhs_scales, rhs_scales, rhs_block))
    return out

  @parameterized.product(shape=[(128, 256, 256), (64, 128, 128)],
                         out_dtype=[jnp.bfloat16, jnp.float16, jnp.float32])
  def test_matches_reference(self, shape, out_dtype):
    self.check(*shape, seed=5, out_dtype=out_dtype)

  @parameterized.parameters((100, 200, 136), (8, 40, 300), (200, 384, 64))
  def test_any_m_k_and_n(self, m, k, n):
    """M, N off the tile and K off the scale block: padded with zeros."""
    self.check(m, k, n, seed=7)

  @parameterized.parameters(range(6))
  def test_random_problems(self, seed):
    """Drawn problems (`testing.random_size`): M, K and N up to 300, the RHS
    in (128, 128) or (1, 128) blocks, each output dtype and activation, a
    bias or none, on this class's config. Draw 5 (251x4x198, gelu into
    float16) has outputs in float16's subnormals."""
    rng = np.random.default_rng(400 + seed)
    m, k, n = (testing.random_size(rng, 300) for _ in range(3))
    self.check(m, k, n, seed=seed,
               out_dtype=(jnp.bfloat16, jnp.float16, jnp.float32)[rng.integers(3)],
               epilogue=Epilogue(activation=base.ACTIVATIONS[rng.integers(len(base.ACTIVATIONS))],
                                 has_bias=bool(rng.integers(2))),
               rhs_block=(SQUARE_BLOCK, ROW_BLOCK)[rng.integers(2)])

  @parameterized.product(activation=base.ACTIVATIONS, has_bias=[False, True])
  def test_fused_epilogue(self, activation, has_bias):
    self.check(128, 256, 128, seed=9, out_dtype=jnp.float32,
               epilogue=Epilogue(activation=activation, has_bias=has_bias))

  @parameterized.parameters((128, 256, 256), (100, 200, 136))
  def test_output_quantized_in_the_epilogue(self, m, k, n):
    self.check_quantized_output(m, k, n)

  def check_quantized_output(self, m, k, n, rhs_block=SQUARE_BLOCK, config=None):
    """out_dtype=float8_e4m3fn: the output in (1, 128) blocks, its scales
    those `quantize_fp8` gives the float32 result (up to float32 summation),
    each element within e4m3's rounding of the reference; and it feeds the
    next `fp8_matmul` as its LHS."""
    lhs, lhs_scales, rhs, rhs_scales = quantized_operands(25, m, k, n, rhs_block)
    bias = testing.random_array(26, (n,), jnp.float32)
    config = self.config if config is None else config
    values, scales = self.run_kernel(fp8_matmul, lhs, rhs, lhs_scales, rhs_scales, bias,
                                     activation="gelu", out_dtype=jnp.float8_e4m3fn,
                                     config=config)
    ref = fp8_matmul_reference(lhs, rhs, lhs_scales, rhs_scales, bias,
                               epilogue=Epilogue(activation="gelu", has_bias=True))
    self.assertEqual((values.shape, values.dtype), ((m, n), jnp.dtype(jnp.float8_e4m3fn)))
    self.assertEqual((scales.shape, scales.dtype),
                     (scales_shape((m, n), ROW_BLOCK), jnp.dtype(jnp.float32)))
    # Each block's scale is its largest magnitude over E4M3_MAX, and that
    # magnitude is off by no more than the block's largest element bound. Not
    # a fraction of the scale: where a block's elements cancel, their error is
    # a large part of them (with RHS scales per row, the 8-column block of an
    # N = 136 output is such a block, and a 2e-3 relative bound failed on the H200).
    accumulation = accumulation_bound(lhs, rhs, lhs_scales, rhs_scales, rhs_block)
    want_scales = np.asarray(quantize_fp8_reference(ref, ROW_BLOCK)[1])
    scale_error = np.abs(np.asarray(scales) - want_scales)
    scale_bound = row_block_max(accumulation) / E4M3_MAX + 1e-6 * want_scales
    self.assertTrue(np.all(scale_error <= scale_bound),
                    f"scales: worst excess {np.nanmax(scale_error - scale_bound):.3g}")
    ref = np.asarray(ref)
    scale_of_each = np.asarray(dequantize_fp8(jnp.ones((m, n), jnp.float8_e4m3fn), scales))
    # e4m3's rounding of the kernel's value, which is within `accumulation` of ref.
    bound = ((E4M3_RELATIVE_ROUNDING + 2e-3) * np.abs(ref)
             + E4M3_RELATIVE_ROUNDING * accumulation
             + E4M3_SUBNORMAL_ROUNDING * scale_of_each
             + accumulation)
    error = np.abs(np.asarray(dequantize_fp8(values, scales)) - ref)
    self.assertTrue(np.all(error <= bound), f"worst excess {np.nanmax(error - bound):.3g}")
    _, _, next_rhs, next_rhs_scales = quantized_operands(27, m, n, 64)
    out = self.run_kernel(fp8_matmul, values, next_rhs, scales, next_rhs_scales,
                          config=config)
    self.assertEqual(out.shape, (m, 64))

  @parameterized.parameters(((128, 256, 256), False, jnp.bfloat16),
                            ((100, 200, 136), True, jnp.float32),
                            ((100, 200, 136), True, jnp.float8_e4m3fn))
  def test_rhs_scaled_per_row(self, shape, has_bias, out_dtype):
    """RHS scales per row and 128 of K (a weight gradient's cotangent), whose
    magnitudes differ between rows: each step scales each column by its own."""
    if jnp.dtype(out_dtype) == jnp.float8_e4m3fn:
      self.check_quantized_output(*shape, rhs_block=ROW_BLOCK)
    else:
      self.check(*shape, seed=43, out_dtype=out_dtype, rhs_block=ROW_BLOCK,
                 epilogue=Epilogue(activation="gelu", has_bias=has_bias))

  @parameterized.parameters(1, 2, 3)
  def test_pipeline_depths(self, steps):
    self.check(64, 512, 128, seed=13,
               config=dataclasses.replace(self.config, max_concurrent_steps=steps))

  def test_error_does_not_grow_with_k(self):
    """The scaled sum of each 128-long block runs in float32 outside the
    tensor cores: at K = 4096 the float32 output keeps the bound that holds
    at K = 128."""
    self.check(64, 4096, 128, seed=15, out_dtype=jnp.float32)

  @parameterized.product(has_bias=[False, True], rhs_block=[SQUARE_BLOCK, ROW_BLOCK])
  def test_lowers_for_the_gpu(self, has_bias, rhs_block):
    """Mosaic GPU's own checks (wgmma's operand layouts for 8-bit types, the
    TMA copies) run when the kernel is lowered for CUDA, which a CPU does too."""
    lhs, lhs_scales, rhs, rhs_scales = quantized_operands(23, 100, 200, 136, rhs_block)
    bias = testing.random_array(24, (136,), jnp.float32) if has_bias else None
    text = testing.lowered_for_gpu(
        lambda *a: fp8_matmul(*a, bias, activation="silu", config=self.config),
        lhs, rhs, lhs_scales, rhs_scales)
    self.assertEqual(testing.mosaic_kernel_count(text), 1)

  def test_real_size(self):
    if self.backend != testing.GPU:
      self.skipTest("real sizes run on the GPU only (minutes in the interpreter)")
    self.check(2048, 8192, 4096, seed=17)

  def test_more_than_256_scale_blocks(self):
    """K over 32768: a row of RHS scales is more than one TMA box long, so
    it is copied in several (one copy failed to lower on the H200, at the
    d x product of a 37888-wide layer): lowered for CUDA, and run."""
    k = 128 * 257
    lhs, lhs_scales, rhs, rhs_scales = quantized_operands(41, 64, k, 128)
    text = testing.lowered_for_gpu(lambda *a: fp8_matmul(*a, config=self.config),
                                   lhs, rhs, lhs_scales, rhs_scales)
    self.assertEqual(testing.mosaic_kernel_count(text), 1)
    self.check(64, k, 128, seed=41, out_dtype=jnp.float32)

  @parameterized.parameters((0, 256, 128), (64, 256, 0), (64, 0, 128))
  def test_empty_problems_launch_no_kernel(self, m, k, n):
    lhs = jnp.zeros((m, k), jnp.float8_e4m3fn)
    rhs = jnp.zeros((n, k), jnp.float8_e4m3fn)
    bias = testing.random_array(19, (n,), jnp.float32)
    want = np.broadcast_to(np.maximum(np.asarray(bias), 0), (m, n))
    with base.no_kernel_built():
      out = fp8_matmul(lhs, rhs, jnp.float32(1.0), jnp.float32(1.0), bias, activation="relu",
                       out_dtype=jnp.float32)
      values, scales = fp8_matmul(lhs, rhs, jnp.float32(1.0), jnp.float32(1.0), bias,
                                  activation="relu", out_dtype=jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(out), want)
    self.assertEqual(scales.shape, scales_shape((m, n), ROW_BLOCK))
    np.testing.assert_allclose(np.asarray(dequantize_fp8(values, scales)), want,
                               rtol=E4M3_RELATIVE_ROUNDING)

  def test_errors(self):
    lhs, lhs_scales, rhs, rhs_scales = quantized_operands(21, 64, 256, 128)
    with self.assertRaisesRegex(ValueError, "lhs.dtype=bfloat16 must be float8_e4m3fn"):
      fp8_matmul(lhs.astype(jnp.bfloat16), rhs, lhs_scales, rhs_scales)
    with self.assertRaisesRegex(ValueError, r"K of lhs \(M, K\) and rhs \(N, K\) differ"):
      fp8_matmul(lhs, rhs[:, :128], lhs_scales, rhs_scales)
    with self.assertRaisesRegex(ValueError, r"lhs_scales must have shape \(64, 2\)"):
      fp8_matmul(lhs, rhs, lhs_scales.T, rhs_scales)
    with self.assertRaisesRegex(ValueError, r"rhs_scales must have shape \(1, 2\) \(one per 128 "
                                r"of N and 128 of K\) or \(128, 2\) \(one per row"):
      fp8_matmul(lhs, rhs, lhs_scales, jnp.ones((64, 2), jnp.float32))
    with self.assertRaisesRegex(ValueError, "rhs_scales must be a float32 array"):
      fp8_matmul(lhs, rhs, lhs_scales, rhs_scales.astype(jnp.bfloat16))
    with self.assertRaisesRegex(ValueError, r"bias must have shape \(N,\)=\(128,\)"):
      fp8_matmul(lhs, rhs, lhs_scales, rhs_scales, jnp.zeros((64,)))
    with self.assertRaisesRegex(ValueError, "bias.dtype=int32 must be a real float dtype"):
      fp8_matmul(lhs, rhs, lhs_scales, rhs_scales, jnp.zeros((128,), jnp.int32))
    # Block scales and one scale per operand run different kernels.
    for scales in ((lhs_scales, rhs_scales), (jnp.float32(1.0), jnp.float32(1.0))):
      with self.assertRaisesRegex(TypeError, "fp8_matmul is not differentiable.*fp8_linear"):
        jax.eval_shape(jax.grad(lambda s, scales=scales: fp8_matmul(
            lhs, rhs, *scales, s, config=self.config).astype(jnp.float32).sum()),
            jnp.zeros((128,), jnp.float32))
    with self.assertRaisesRegex(ValueError, "activation='tanh'"):
      fp8_matmul(lhs, rhs, lhs_scales, rhs_scales, activation="tanh")
    with self.assertRaisesRegex(ValueError, "config must be an Fp8Config"):
      fp8_matmul(lhs, rhs, lhs_scales, rhs_scales, config=object())
    with self.assertRaisesRegex(ValueError, "max_concurrent_steps must be an int >= 1"):
      Fp8Config(max_concurrent_steps=0)
    with self.assertRaisesRegex(ValueError, "compute_wgs=4 must be 1, 2 or 3"):
      Fp8Config(compute_wgs=4)


class Fp8MatmulWarpSpecializedTest(Fp8MatmulTest):
  """The same cases on (128, 128) tiles: two compute warpgroups and a memory
  warpgroup (`emit_fp8_matmul_warp_specialized`), one block per tile."""

  config = Fp8Config(compute_wgs=2, persistent=False)


class Fp8MatmulPersistentTest(Fp8MatmulWarpSpecializedTest):
  """The same cases on the persistent kernel (`emit_fp8_matmul_persistent`),
  its grid capped at 2 blocks, so that a block walks several tiles."""

  config = Fp8Config()

  def setUp(self):
    super().setUp()
    self.enterContext(base.with_blocks(2))

  # 9 tiles on 2 blocks: each compute warpgroup loads a tile's RHS scales and
  # bias while the other may still be finishing the last tile, and the memory
  # warpgroup loads a tile while both still compute the last.
  SEVERAL_TILES = (384, 512, 384)

  @parameterized.parameters(False, True)
  def test_blocks_walk_several_tiles(self, has_bias):
    self.check(*self.SEVERAL_TILES, seed=51,
               epilogue=Epilogue(activation="gelu", has_bias=has_bias))

  def test_blocks_walk_several_tiles_quantizing_the_output(self):
    self.check_quantized_output(*self.SEVERAL_TILES)

  TWO_BLOCK_STEPS = Fp8Config(k_blocks_per_step=2, max_concurrent_steps=2)

  @parameterized.parameters(
      # 10 blocks in 5 steps of 2 on 2 slots: the slots wrap twice.
      ((128, 1280, 256), SQUARE_BLOCK, False),
      ((100, 1280, 136), ROW_BLOCK, True),
      # Several tiles on 2 blocks, each K loop of 2 steps.
      ((384, 512, 384), SQUARE_BLOCK, True),
      ((384, 512, 384), ROW_BLOCK, False),
      # 3 blocks: steps of one block.
      ((128, 384, 128), SQUARE_BLOCK, True))
  def test_steps_of_two_blocks(self, shape, rhs_block, has_bias):
    """`k_blocks_per_step=2`: each step's two blocks in two accumulators,
    the first added while the second's wgmmas run."""
    self.check(*shape, seed=61, out_dtype=jnp.float32, rhs_block=rhs_block,
               config=self.TWO_BLOCK_STEPS,
               epilogue=Epilogue(activation="silu", has_bias=has_bias))

  @parameterized.parameters((SQUARE_BLOCK,), (ROW_BLOCK,))
  def test_steps_of_two_blocks_lower_for_the_gpu(self, rhs_block):
    """Mosaic GPU's checks of the two accumulators and the half-width
    operand slices, for CUDA (a CPU lowers too)."""
    lhs, lhs_scales, rhs, rhs_scales = quantized_operands(63, 128, 512, 256, rhs_block)
    text = testing.lowered_for_gpu(
        lambda *a: fp8_matmul(*a, config=self.TWO_BLOCK_STEPS), lhs, rhs, lhs_scales,
        rhs_scales)
    self.assertEqual(testing.mosaic_kernel_count(text), 1)

  def test_steps_of_two_blocks_quantizing_the_output(self):
    self.check_quantized_output(*self.SEVERAL_TILES, config=self.TWO_BLOCK_STEPS)

  def test_steps_of_two_blocks_need_the_persistent_kernel(self):
    for config in (dict(compute_wgs=1), dict(persistent=False)):
      with self.assertRaisesRegex(ValueError, "k_blocks_per_step=2 needs the persistent kernel"):
        Fp8Config(k_blocks_per_step=2, **config)
    with self.assertRaisesRegex(ValueError, "k_blocks_per_step=3 must be 1 or 2"):
      Fp8Config(k_blocks_per_step=3)

  def test_needs_a_memory_warpgroup(self):
    with self.assertRaisesRegex(ValueError, "persistent=True needs compute_wgs > 1"):
      Fp8Config(persistent=True, compute_wgs=1)

  def test_is_the_default_with_a_memory_warpgroup(self):
    self.assertEqual((Fp8Config().runs_persistent, Fp8Config(compute_wgs=1).runs_persistent,
                      dataclasses.replace(Fp8Config(), compute_wgs=1).runs_persistent,
                      Fp8Config(persistent=False).runs_persistent), (True, False, False, False))


class Fp8MatmulThreeWarpgroupsTest(Fp8MatmulWarpSpecializedTest):
  """The same cases on the persistent kernel's (192, 128) tiles of three
  compute warpgroups, its grid capped at 2 blocks."""

  # 3 stages: a float32 output's staging tile leaves no SMEM for a fourth.
  config = Fp8Config(compute_wgs=3, max_concurrent_steps=3)

  def setUp(self):
    super().setUp()
    self.enterContext(base.with_blocks(2))

  # 3 x 3 tiles on 2 blocks, the last row tile 136 of 192 rows: its second
  # warpgroup's rows reach past M, its third's all lie past M.
  SEVERAL_TILES = (520, 512, 384)

  @parameterized.parameters((False, ROW_BLOCK), (True, SQUARE_BLOCK))
  def test_blocks_walk_several_tiles(self, has_bias, rhs_block):
    """In 4 stages, as a 16-bit output takes them by default."""
    self.check(*self.SEVERAL_TILES, seed=71, rhs_block=rhs_block,
               config=Fp8Config(compute_wgs=3),
               epilogue=Epilogue(activation="gelu", has_bias=has_bias))

  def test_blocks_walk_several_tiles_quantizing_the_output(self):
    self.check_quantized_output(*self.SEVERAL_TILES)

  def test_reads_and_writes_m_in_place(self):
    """M a multiple of 8 but not of the tile: neither the LHS nor the output
    is copied to whole tiles (the kernel's last tile reaches past M)."""
    lhs, lhs_scales, rhs, rhs_scales = quantized_operands(73, 520, 256, 256)
    jaxpr = jax.make_jaxpr(functools.partial(fp8_matmul, config=self.config))(
        lhs, rhs, lhs_scales, rhs_scales)
    copies = [eqn.primitive.name for eqn in testing.equations(jaxpr.jaxpr)
              if eqn.primitive.name in ("pad", "slice")
              and eqn.invars[0].aval.size >= 520 * 256]
    self.assertEqual(copies, [])

  def test_only_on_the_persistent_kernel(self):
    with self.assertRaisesRegex(ValueError, "compute_wgs=3 runs only on the persistent kernel"):
      Fp8Config(compute_wgs=3, persistent=False)
    with self.assertRaisesRegex(ValueError, "k_blocks_per_step=2 needs compute_wgs <= 2"):
      Fp8Config(compute_wgs=3, k_blocks_per_step=2)
    self.assertTrue(Fp8Config(compute_wgs=3).runs_persistent)

  @parameterized.parameters(((6144, 4096, 14336), jnp.bfloat16, Fp8Config(compute_wgs=3)),
                            ((8192, 14336, 4096), jnp.bfloat16, Fp8Config(compute_wgs=3)),
                            ((8192, 4096, 4096), jnp.float32,
                             Fp8Config(compute_wgs=3, max_concurrent_steps=3)),
                            ((128, 4096, 4096), jnp.bfloat16, Fp8Config()),
                            ((256, 4096, 14336), jnp.float32, Fp8Config()))
  def test_default_config(self, shape, out_dtype, want):
    """Three warpgroups unless their 192-row tiles leave the busiest SM
    more than 1.12x the rows of 128-row tiles (132 SMs), in as many stages
    as fit."""
    with testing.facts_of_the_fitted_gpu():
      self.assertEqual(fp8_default_config(*shape, out_dtype), want)


class Fp8PerTensorTest(testing.KernelTestCase):
  """One scale per operand: `fp8_matmul` on `matmul`'s persistent kernel,
  which sums all of K in the tensor cores and scales the columns in its
  epilogue."""

  # The tensor cores' sum loses about 2**-14 of the running sum per 32-long
  # K step, which grows with K: the element-wise bound is the block kernel's
  # or (K / 32) * 2**-13, twice that worst case, whichever is larger.
  K_STEP_BOUND = 2.0**-13 / 32

  def check(self, m, k, n, *, seed, out_dtype=jnp.bfloat16, epilogue=Epilogue()):
    lhs = testing.random_array(seed, (m, k), jnp.float32).astype(jnp.float8_e4m3fn)
    rhs = (testing.random_array(seed + 1, (n, k), jnp.float32) * 4).astype(jnp.float8_e4m3fn)
    lhs_scale, rhs_scale = jnp.float32(0.03), jnp.float32(2.0)
    bias = testing.random_array(seed + 3, (n,), jnp.float32) if epilogue.has_bias else None
    out = self.run_kernel(fp8_matmul, lhs, rhs, lhs_scale, rhs_scale, bias,
                          activation=epilogue.activation, out_dtype=out_dtype)
    ref = fp8_matmul_reference(lhs, rhs, lhs_scale, rhs_scale, bias, epilogue=epilogue)
    growth = max(SUM_OF_MAGNITUDES_BOUND, k * self.K_STEP_BOUND) / SUM_OF_MAGNITUDES_BOUND
    assert_product_close(self, out, ref, out_dtype,
                         growth * accumulation_bound(lhs, rhs, lhs_scale, rhs_scale))
    return out

  @parameterized.product(shape=[(128, 256, 256), (64, 512, 128)],
                         out_dtype=[jnp.bfloat16, jnp.float16, jnp.float32])
  def test_matches_reference(self, shape, out_dtype):
    self.check(*shape, seed=31, out_dtype=out_dtype)

  @parameterized.parameters((100, 200, 136), (8, 40, 300), (300, 384, 64))
  def test_any_m_k_and_n(self, m, k, n):
    """M, N and K off the tiles: padded with zeros."""
    self.check(m, k, n, seed=33)

  @parameterized.product(activation=base.ACTIVATIONS, has_bias=[False, True])
  def test_fused_epilogue(self, activation, has_bias):
    self.check(128, 256, 128, seed=35, out_dtype=jnp.float32,
               epilogue=Epilogue(activation=activation, has_bias=has_bias))

  def test_real_size(self):
    if self.backend != testing.GPU:
      self.skipTest("real sizes run on the GPU only (minutes in the interpreter)")
    self.check(2048, 4096, 4096, seed=37)

  def test_runs_the_persistent_kernel(self):
    """Per-tensor scales and a 16-bit output take the persistent kernel; an
    e4m3 output or block scales the block kernel."""
    lhs, lhs_scales, rhs, rhs_scales = quantized_operands(29, 100, 200, 136)
    one = jnp.float32(1.0)
    for scales, out_dtype, kernel in (((one, one), jnp.bfloat16, "ws_matmul_cooperative_NT"),
                                      ((one, one), jnp.float8_e4m3fn, "fp8_block_scaled_matmul"),
                                      ((lhs_scales, one), jnp.bfloat16,
                                       "fp8_block_scaled_matmul")):
      text = testing.lowered_for_gpu(
          lambda a, b, *s, o=out_dtype: fp8_matmul(a, b, *s, out_dtype=o), lhs, rhs, *scales)
      self.assertEqual(testing.mosaic_kernel_count(text), 1)
      self.assertIn(kernel, text)

  def test_lowers_for_the_gpu(self):
    """Mosaic GPU's checks of the persistent kernel on e4m3 operands, with
    the bias and activation fused."""
    lhs, _, rhs, _ = quantized_operands(39, 100, 200, 136)
    bias = testing.random_array(40, (136,), jnp.float32)
    text = testing.lowered_for_gpu(
        lambda a, b: fp8_matmul(a, b, jnp.float32(0.5), jnp.float32(2.0), bias,
                                activation="silu"), lhs, rhs)
    self.assertEqual(testing.mosaic_kernel_count(text), 1)


class Fp8LinearTest(testing.KernelTestCase):
  """`fp8_linear`: each of its three products is `fp8_matmul` of the operands
  quantized as the layer says, and the whole is within e4m3's error of the
  float32 layer."""

  def operands(self, m, k, n, dtype=jnp.bfloat16):
    return (testing.random_array(31, (m, k), dtype), testing.random_array(32, (k, n), dtype),
            testing.random_array(33, (n,), jnp.float32), testing.random_array(34, (m, n), dtype))

  def quantized_product(self, lhs_rows, rhs_rows, bias=None, rhs_block=SQUARE_BLOCK):
    """The float32 reference of one of the layer's products, on the operands
    quantized as the layer quantizes them."""
    lhs, lhs_scales = quantize_fp8_reference(lhs_rows, ROW_BLOCK)
    rhs, rhs_scales = quantize_fp8_reference(rhs_rows, rhs_block)
    return fp8_matmul_reference(lhs, rhs, lhs_scales, rhs_scales, bias,
                                epilogue=Epilogue(has_bias=bias is not None))

  @parameterized.parameters((128, 256, 256), (100, 200, 136))
  def test_gradients(self, m, k, n):
    x, w, bias, g = self.operands(m, k, n)
    run = jax.jit(lambda x, w, b: jax.vjp(fp8_linear, x, w, b))
    out, vjp = self.run_kernel(run, x, w, bias)
    d_x, d_w, d_bias = self.run_kernel(jax.jit(vjp), g)
    self.assertEqual([(a.shape, a.dtype) for a in (out, d_x, d_w, d_bias)],
                     [((m, n), x.dtype), (x.shape, x.dtype), (w.shape, w.dtype),
                      (bias.shape, bias.dtype)])
    # Each product is the FP8 product of what the layer quantized ...
    self.assert_close(out, self.quantized_product(x, w.T, bias), dtype=jnp.bfloat16)
    self.assert_close(d_x, self.quantized_product(g, w), dtype=jnp.bfloat16)
    self.assert_close(d_w, self.quantized_product(x.T, g.T, rhs_block=ROW_BLOCK),
                      dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(d_bias), np.asarray(jnp.sum(g.astype(jnp.float32), 0)),
                               rtol=1e-5, atol=1e-4)
    # ... and the layer is within e4m3's error of the float32 one.
    exact = jax.vjp(lambda x, w, b: x @ w + b, *(a.astype(jnp.float32) for a in (x, w)), bias)
    exact_grads = exact[1](g.astype(jnp.float32))
    for name, got, want in zip(("out", "d_x", "d_w"), (out, d_x, d_w),
                               (exact[0], *exact_grads[:2]), strict=True):
      self.assertLess(relative_error(got, want), FP8_LAYER_TOLERANCE, name)

  def test_weight_gradient_scales_each_output_column(self):
    """d w of a cotangent whose odd columns are 2**-20 of its even ones: in
    blocks of 128 columns the even ones' scale would round the odd ones to
    zero; with a scale per column each is within e4m3's error."""
    x, w, _, g = self.operands(128, 256, 256)
    g = g * jnp.where(jnp.arange(256) % 2, 2.0**-20, 1.0).astype(g.dtype)
    d_w = self.run_kernel(jax.jit(lambda x, w, g: jax.vjp(fp8_linear, x, w)[1](g)[1]), x, w, g)
    want = x.astype(jnp.float32).T @ g.astype(jnp.float32)
    for parity in (0, 1):
      self.assertLess(relative_error(d_w[:, parity::2], want[:, parity::2]),
                      FP8_LAYER_TOLERANCE, f"columns {parity}::2")

  def test_lowers_for_the_gpu_to_one_quantization_kernel_per_operand(self):
    """The forward alone: x and w quantized in the layout it takes (one
    kernel each) and the product. The gradients: x, w and g each quantized
    in both layouts by one kernel, and the two backward products (the
    forward's product is unused here)."""
    x, w, _, g = self.operands(128, 256, 256)
    for run, kernels in ((fp8_linear, 3), (lambda x, w: jax.vjp(fp8_linear, x, w)[1](g), 5)):
      text = testing.lowered_for_gpu(run, x, w)
      self.assertEqual(testing.mosaic_kernel_count(text), kernels)
      self.assertEqual("fp8_quantize_both_layouts" in text, kernels == 5)

  def test_leading_dimensions_are_rows(self):
    """A (batch, sequence, K) activation, as a Dense layer gets it, under
    jit and grad: the same as its rows folded into M."""
    x, w, bias, _ = self.operands(128, 256, 128)
    batched = x.reshape(2, 64, 256)

    def loss(x, w, b):
      return jnp.sum(fp8_linear(x, w, b).astype(jnp.float32) ** 2)

    got = self.run_kernel(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), batched, w, bias)
    want = self.run_kernel(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), x, w, bias)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    for g, h in zip(got[1], want[1], strict=True):
      np.testing.assert_array_equal(np.asarray(g).reshape(h.shape), np.asarray(h))

  def test_errors(self):
    x, w, bias, _ = self.operands(64, 128, 128)
    with self.assertRaisesRegex(ValueError, "x must be .* at least one row dimension"):
      fp8_linear(x[0], w)
    with self.assertRaisesRegex(ValueError, r"w must be 2-D \(K, N\)"):
      fp8_linear(x, w[None])
    with self.assertRaisesRegex(ValueError, "lhs and rhs dtypes differ"):
      fp8_linear(x, w.astype(jnp.float16))
    with self.assertRaisesRegex(ValueError, r"bias must have shape \(N,\)=\(128,\)"):
      fp8_linear(x, w, bias[:64])


if __name__ == "__main__":
  absltest.main()
