"""Collective matmuls across GPUs: the ring all-gather matmul and its portable XLA twins.

    out = collectives.all_gather_matmul(lhs, rhs, "x")   # inside jax.shard_map over "x"

`all_gather_matmul` runs the Mosaic GPU ring kernel (`all_gather_lhs_matmul`)
on Hopper GPUs that reach each other's memory, with a config that tiles the
shards (`default_ring_config`); elsewhere `lax.all_gather` + one dot on GPUs
(`all_gather_then_matmul`) and the XLA ring (`ring_all_gather_matmul`) on
other backends. Only the Mosaic ring kernel builds on `pipelines`, through
`emit_cooperative_matmul`'s `pipeline_callback` and `delay_release` hooks; the XLA
ring and `all_gather_then_matmul` multiply with `jnp.dot` (the XLA ring
accepts `config` for the same signature and ignores it).
"""

from collectives.all_gather_matmul import (
  Implementation,
  all_gather_matmul,
  choose_implementation,
  decide_implementation,
)
from collectives.portable import all_gather_then_matmul, ring_all_gather_matmul
from collectives.ring_config import default_ring_config
from collectives.ring_matmul_sm90 import all_gather_lhs_matmul

__all__ = [
    "Implementation", "all_gather_lhs_matmul", "all_gather_matmul", "all_gather_then_matmul",
    "choose_implementation", "decide_implementation", "default_ring_config",
    "ring_all_gather_matmul",
]
