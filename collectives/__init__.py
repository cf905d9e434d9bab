"""Collective matmuls across GPUs: ring kernels and their portable XLA twins.

    out = collectives.all_gather_matmul(x, w, "x")       # all_gather(x) @ w, inside shard_map
    out = collectives.matmul_reduce_scatter(h, w, "x")   # reduce_scatter(h @ w)

`all_gather_matmul` runs the Mosaic GPU ring kernel (`all_gather_lhs_matmul`)
on Hopper GPUs that reach each other's memory, with a config that tiles the
shards (`default_ring_config`); elsewhere `lax.all_gather` + one dot on GPUs
(`all_gather_then_matmul`) and the XLA ring (`ring_all_gather_matmul`) on
other backends. `matmul_reduce_scatter` chooses the same way between the
Mosaic reduce-scatter ring (`ring_matmul_reduce_scatter`), one dot +
`lax.psum_scatter` (`matmul_then_reduce_scatter`) and its XLA ring
(`xla_ring_matmul_reduce_scatter`). Both are differentiable, each one's
backward made of the other (`api.py`). Only the Mosaic ring kernels build on
`pipelines`, through `emit_cooperative_matmul`'s hooks (`pipeline_callback` and
`delay_release` for the all-gather, `addend_gmem` for the reduce-scatter); the
XLA forms multiply with XLA's dot (the XLA rings
accept `config` for the same signature and ignore it).
"""

from collectives.all_gather_matmul import (
  choose_implementation,
  decide_implementation,
)
from collectives.api import all_gather_matmul, matmul_reduce_scatter
from collectives.dispatch import Implementation
from collectives.matmul_reduce_scatter import (
  choose_implementation as choose_reduce_scatter_implementation,
)
from collectives.matmul_reduce_scatter import (
  decide_implementation as decide_reduce_scatter_implementation,
)
from collectives.portable import (
  all_gather_then_matmul,
  matmul_then_reduce_scatter,
  ring_all_gather_matmul,
  xla_ring_matmul_reduce_scatter,
)
from collectives.ring_config import default_ring_config
from collectives.ring_matmul_sm90 import all_gather_lhs_matmul
from collectives.ring_reduce_scatter_sm90 import ring_matmul_reduce_scatter

__all__ = [
    "Implementation", "all_gather_lhs_matmul", "all_gather_matmul", "all_gather_then_matmul",
    "choose_implementation", "choose_reduce_scatter_implementation", "decide_implementation",
    "decide_reduce_scatter_implementation", "default_ring_config", "matmul_reduce_scatter",
    "matmul_then_reduce_scatter", "ring_all_gather_matmul", "ring_matmul_reduce_scatter",
    "xla_ring_matmul_reduce_scatter",
]
