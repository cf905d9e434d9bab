"""The fused epilogue of the warp-specialized matmul: bias, activation, cast.

Applied in float32 to the accumulator in registers before it is cast and
stored, so users need no separate XLA ops (and no extra pass over the output)
after the matmul.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

ACTIVATIONS = ("none", "relu", "gelu", "silu")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Epilogue:
  """What happens to each output element after the K loop.

  Attributes:
    activation: "none", "relu", "gelu" (tanh approximation) or "silu".
    has_bias: whether a (N,) bias is added before the activation.
  """

  activation: str = "none"
  has_bias: bool = False

  def __post_init__(self):
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation={self.activation!r} must be one of {ACTIVATIONS}")

  def apply(self, x: jax.Array) -> jax.Array:
    """The activation on float32 values (in a kernel or in the reference)."""
    match self.activation:
      case "relu":
        return jnp.maximum(x, 0.0)
      case "gelu":
        # Written out (not jax.nn.gelu) so the kernel and the reference use
        # the same formula, built only from ops Mosaic GPU lowers.
        return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
      case "silu":
        return x / (1.0 + jnp.exp(-x))
    return x
