"""The cases every matmul implementation must pass, written once.

Each implementation's test is a short subclass of `MatmulTestBase` that says
how to call it (`run_matmul`) and what it supports; the cases, the float32
reference, the tolerances, the poisoning and the race check live here and in
`core.testing`. A case an implementation does not support skips and says why.
Test support only: no kernel module imports this.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import parameterized
from jax.experimental.pallas import mosaic_gpu as plgpu

from core import device, testing
from pipelines import Epilogue, kernel_call, matmul_reference
from pipelines.config import MatmulDimension
from pipelines.operands import NN, OperandLayout

DTYPES = (jnp.float16, jnp.bfloat16)
ACTIVATIONS = ("none", "relu", "gelu", "silu")
# Epilogue tilings whose store count per tile is odd (3 sub-tiles through 2
# staging slots), so consecutive tiles of a block start on different slots.
ODD_EPILOGUE_TILINGS = (
    dict(tile_m=64, tile_n=192, epi_tile_m=64, epi_tile_n=64),
    dict(tile_m=192, tile_n=64, epi_tile_m=64, epi_tile_n=64),
)
LAYOUTS = tuple(OperandLayout(transpose_lhs=tl, transpose_rhs=tr)
                for tl in (False, True) for tr in (False, True))


def operands(seed: int, m: int, k: int, n: int, dtype, layout: OperandLayout = NN):
  """Random normal operands of an (M, K) x (K, N) problem, stored as `layout` says."""
  return (testing.random_array(seed, layout.lhs_shape(m, k), dtype),
          testing.random_array(seed + 1, layout.rhs_shape(k, n), dtype))


def no_kernel_built():
  """Fails the test if anything inside builds a Mosaic GPU kernel."""
  return mock.patch.object(plgpu, "kernel", side_effect=AssertionError("a kernel was built"))


def kernel_output_shapes(fn, *args) -> list[list[tuple[int, ...]]]:
  """The output shapes of each Mosaic GPU kernel that tracing `fn(*args)` builds.

  JAX caches traces by shape, so a kernel already traced with these shapes
  in this process is not built again and does not appear.
  """
  with mock.patch.object(plgpu, "kernel", wraps=plgpu.kernel) as kernel:
    jax.eval_shape(fn, *args)
  return [[out.shape for out in jax.tree.leaves(call.kwargs["out_type"])]
          for call in kernel.call_args_list]


def with_blocks(num_blocks: int | None):
  """Caps the persistent grid at `num_blocks`, so each block loops over several
  tiles; None leaves the grid as the device makes it."""
  if num_blocks is None:
    return contextlib.nullcontext()
  facts = dataclasses.replace(device.device_facts(), sm_count=num_blocks)
  return mock.patch.object(kernel_call, "device_facts", return_value=facts)


class MatmulTestBase(testing.KernelTestCase):
  """Cases for one matmul implementation; subclasses override `run_matmul`.

  Attributes (what the implementation supports):
    supports_epilogue: bias and activation.
    supports_ragged: M and N that are not multiples of the tile.
    supports_k_padding: K a multiple of 16 but not of the K tile.
    tiled_by_config: the config has epilogue tiles (`ODD_EPILOGUE_TILINGS`)
      and a persistent grid (`with_blocks`).
    supports_layouts: operands stored transposed (`LAYOUTS`).
  """

  supports_epilogue = True
  supports_ragged = True
  supports_k_padding = True
  tiled_by_config = True
  supports_layouts = True
  # Aligned shapes for implementations that need whole tiles.
  aligned_shapes = ((128, 256, 128), (256, 128, 256))

  def run_matmul(self, lhs, rhs, bias=None, *, epilogue: Epilogue = Epilogue(),
                 out_dtype=None, config_fields: dict | None = None,
                 layout: OperandLayout = NN):
    """`epilogue(op(lhs) @ op(rhs) + bias)` with the implementation under test.

    `config_fields` overrides fields of the implementation's config (only
    when `tiled_by_config`); `layout` is passed only when `supports_layouts`.
    """
    raise NotImplementedError

  def requires(self, what: str, supported: bool) -> None:
    if not supported:
      self.skipTest(f"{type(self).__name__} does not support {what}")

  def check(self, shape, dtype, *, seed: int, epilogue: Epilogue = Epilogue(), out_dtype=None,
            config_fields: dict | None = None, num_blocks: int | None = None,
            layout: OperandLayout = NN):
    """Runs the implementation on random operands, on a persistent grid capped
    at `num_blocks` if given, and compares with the reference; returns the output."""
    m, k, n = shape
    lhs, rhs = operands(seed, m, k, n, dtype, layout)
    bias = testing.random_array(seed + 2, (n,), dtype) if epilogue.has_bias else None
    kwargs = dict(epilogue=epilogue, out_dtype=out_dtype)
    if config_fields:
      kwargs["config_fields"] = config_fields
    if layout != NN:
      kwargs["layout"] = layout
    with with_blocks(num_blocks):
      out = self.run_kernel(self.run_matmul, lhs, rhs, bias, **kwargs)
    self.assertEqual((out.shape, out.dtype), ((m, n), jnp.dtype(out_dtype or dtype)))
    self.assert_close(out, matmul_reference(lhs, rhs, bias, epilogue=epilogue, layout=layout),
                      dtype=dtype)
    return out

  @parameterized.product(dtype=DTYPES, shape_index=[0, 1])
  def test_matches_reference(self, dtype, shape_index):
    self.check(self.aligned_shapes[shape_index], dtype, seed=3)

  @parameterized.parameters(
      (200, 128, 136), (64, 64, 40), (130, 192, 248),
      # Narrower than one 64x128 CTA tile, with several K steps: N so narrow
      # gave wrong products on an H200 until the wrapper padded it.
      (128, 128, 64), (40, 192, 256), (8, 128, 64))
  def test_ragged_m_and_n_are_masked(self, m, k, n):
    self.requires("ragged M and N", self.supports_ragged)
    self.check((m, k, n), jnp.float16, seed=7)

  @parameterized.product(layout_index=list(range(len(LAYOUTS))),
                         shape=[(128, 128, 128), (200, 80, 136)])
  def test_operand_layouts(self, layout_index, shape):
    """Operands stored transposed, on whole tiles and on ragged M, K and N."""
    self.requires("transposed operands", self.supports_layouts)
    self.requires("ragged shapes", self.supports_ragged or shape == (128, 128, 128))
    self.check(shape, jnp.bfloat16, seed=33, layout=LAYOUTS[layout_index],
               epilogue=Epilogue(activation="silu", has_bias=self.supports_epilogue))

  @parameterized.parameters(*range(len(LAYOUTS)))
  def test_minor_dims_on_32_or_64_bytes(self, layout_index):
    """Minor dimensions off 128 bytes but on 64 (M = 160) or 32 (K = 80,
    N = 176): the warp-specialized kernel reads them in place with a narrower
    swizzle, and K's last step is partial."""
    self.requires("transposed operands", self.supports_layouts or layout_index == 0)
    self.requires("ragged shapes", self.supports_ragged)
    self.requires("K off the K tile", self.supports_k_padding)
    epilogue = (Epilogue(activation="relu", has_bias=True) if self.supports_epilogue
                else Epilogue())
    self.check((160, 80, 176), jnp.float16, seed=37, layout=LAYOUTS[layout_index],
               epilogue=epilogue)

  def test_k_steps_of_one_narrow_segment(self):
    """32-element K steps with 128-column RHS tiles (warp-specialized kernels
    only): both operands take the 64-byte swizzle, which N = 160 of the RHS
    also needs, so the LHS tiles are one segment wide and its ragged M = 100
    is read in place, as the heuristic has it for 100x8192x4000."""
    self.requires("K steps narrower than the RHS tile's swizzle", self.tiled_by_config)
    self.check((100, 256, 160), jnp.float16, seed=39,
               config_fields=dict(tile_k=32, tile_n=128, max_concurrent_steps=4,
                                  wg_dimension=MatmulDimension.M),
               epilogue=Epilogue(activation="relu", has_bias=True))

  @parameterized.parameters(MatmulDimension.M, MatmulDimension.N)
  def test_ragged_rhs_in_one_segment_tiles(self, wg_dimension):
    """64-column warpgroup tiles (along M: the heuristic's 128x64 CTA tiles;
    along N: its 64x128 ones, where each warpgroup loads its own RHS tile)
    read a (K, N) RHS whose N = 200 is off 64 columns in place, as
    one-segment boxes that TMA masks at the edge."""
    self.requires("64x64 warpgroup tiles", self.tiled_by_config)
    self.check((100, 256, 200), jnp.float16, seed=41,
               config_fields=dict(tile_m=64, tile_n=64, epi_tile_n=64, max_concurrent_steps=4,
                                  wg_dimension=wg_dimension),
               epilogue=Epilogue(activation="relu", has_bias=True))

  def test_any_k_and_n(self):
    """K and N off every multiple of 32 bytes: padded by the wrapper."""
    self.requires("K off the K tile", self.supports_k_padding)
    self.check((72, 40, 60), jnp.float16, seed=35)

  @parameterized.product(activation=ACTIVATIONS, has_bias=[False, True],
                         out_dtype=[None, jnp.float32])
  def test_fused_epilogue(self, activation, has_bias, out_dtype):
    self.requires("a fused epilogue", self.supports_epilogue or
                  (activation == "none" and not has_bias))
    self.check((128, 128, 192), jnp.bfloat16, seed=4, out_dtype=out_dtype,
               epilogue=Epilogue(activation=activation, has_bias=has_bias))

  @parameterized.parameters(*range(len(ODD_EPILOGUE_TILINGS)))
  def test_odd_epilogue_tilings(self, index):
    """Several tiles per block, each making 3 stores through 2 staging slots:
    a tile's first store must wait for the last store of the one before."""
    self.requires("epilogue tilings", self.tiled_by_config)
    self.check((384, 64, 384), jnp.float16, seed=23, config_fields=ODD_EPILOGUE_TILINGS[index],
               num_blocks=1, epilogue=Epilogue(activation="relu", has_bias=True))

  def test_bias_is_added_in_float32(self):
    self.requires("a bias", self.supports_epilogue)
    self.check_float32_bias()

  def check_float32_bias(self, config_fields: dict | None = None):
    """A float32 bias that cancels most of a large accumulator: cast to a
    float16 output first (70000 -> inf), it would make every element inf."""
    m, k, n = 64, 128, 64
    lhs = jnp.ones((m, k), jnp.float16)
    noise = testing.random_array(25, (k, n), jnp.float32, scale=0.5)
    rhs = (noise - 544.0).astype(jnp.float16)  # Each accumulator about -69632.
    bias = jnp.full((n,), 70000.0, jnp.float32) + testing.random_array(26, (n,), jnp.float32)
    epilogue = Epilogue(activation="relu", has_bias=True)
    kwargs = dict(config_fields=config_fields) if config_fields else {}
    out = self.run_kernel(self.run_matmul, lhs, rhs, bias, epilogue=epilogue, **kwargs)
    ref = matmul_reference(lhs, rhs, bias, epilogue=epilogue)
    self.assertTrue(bool(jnp.all(jnp.abs(ref) < 1000)), "the reference must fit in float16")
    self.assert_close(out, ref, dtype=jnp.float16)

  @parameterized.parameters((0, 64, 64), (64, 64, 0), (0, 0, 0), (64, 0, 128))
  def test_empty_problems_launch_no_kernel(self, m, k, n):
    """As `jnp.dot`: an empty output, or for K = 0 the epilogue of zeros."""
    lhs, rhs = operands(27, m, k, n, jnp.bfloat16)
    epilogue = (Epilogue(activation="silu", has_bias=True) if self.supports_epilogue
                else Epilogue())
    bias = testing.random_array(28, (n,), jnp.float32) if epilogue.has_bias else None
    with no_kernel_built():
      out = self.run_matmul(lhs, rhs, bias, epilogue=epilogue, out_dtype=jnp.float32)
    self.assertEqual((out.shape, out.dtype), ((m, n), jnp.float32))
    self.assert_close(out, matmul_reference(lhs, rhs, bias, epilogue=epilogue),
                      dtype=jnp.float32)

  @parameterized.parameters(16, 48, 80, 144)
  def test_k_multiple_of_16(self, k):
    """K off the 64-wide K tile: a partial last K step (or a pad, for
    implementations that need whole steps)."""
    self.requires("K off the K tile", self.supports_k_padding)
    epilogue = Epilogue(activation="gelu", has_bias=self.supports_epilogue)
    self.check((72, k, 64), jnp.float16, seed=29, epilogue=epilogue)
