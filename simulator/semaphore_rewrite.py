"""Semaphore operations in a traced kernel, turned into calls of the simulated semaphores.

jax 0.11.2's GPU interpreter has no case for the semaphore primitives
(`pl.get_global`, `semaphore_signal`, `semaphore_wait`, `semaphore_read`):
they fall through to `bind`, which fails. `rewrite` replaces their equations
with `inline_mgpu` equations tagged with a `SemaphoreOp` (that case of the
interpreter receives the ordering token, which orders our callbacks with the
interpreter's own), and `interpret_semaphore_op` interprets a tagged equation
as an `io_callback` into `semaphores`.

Semantics:
  * `pl.get_global(plgpu.SemaphoreType.REGULAR)` (also arrays of semaphores,
    indexed with `.at[i]`): one semaphore per device, zero when the kernel
    starts. Every block of the kernel sees the same semaphore, as on a GPU.
  * `pl.semaphore_signal(sem, inc, device_id=...)` (and the `plgpu.` variant):
    adds `inc` to the semaphore on `device_id`, or on this device if omitted.
  * `pl.semaphore_wait(sem, value, decrement=...)`: blocks until the count is
    at least `value`, then subtracts `value` if `decrement` (the default).
  * `pl.semaphore_read(sem)`.
`device_id`s are mesh coordinates as in `pl.semaphore_signal`: an integer on a
1-D mesh, a tuple of coordinates or a `{axis_name: index}` dict on an N-D mesh
(`DeviceIdType.LOGICAL` ids work too).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import callback, source_info_util
from jax._src import core as jax_core
from jax._src.pallas import primitives as pallas_primitives
from jax._src.pallas.mosaic.interpret import utils as interpret_utils
from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.state import indexing

from simulator import semaphores

_SIGNAL_PRIMITIVES = (pallas_primitives.semaphore_signal_p, gpu_primitives.semaphore_signal_p)
_WAIT_PRIMITIVES = (pallas_primitives.semaphore_wait_p, gpu_primitives.semaphore_wait_p)
_SEMAPHORE_PRIMITIVES = (pallas_primitives.get_global_p, pallas_primitives.semaphore_read_p,
                         *_SIGNAL_PRIMITIVES, *_WAIT_PRIMITIVES)

# The parameter of a rewritten equation that carries its `SemaphoreOp`;
# everything else about the equation is kept.
OP_PARAM = "mgpu_collective_op"


@dataclasses.dataclass(frozen=True)
class SemaphoreOp:
  kind: str  # "get_global", "signal", "wait" or "read".
  original_params: dict
  # For "get_global": the id of its first semaphore (ids are unique per process).
  first_id: int = 0

  def __hash__(self):
    return hash((self.kind, self.first_id, id(self.original_params)))


def uses_semaphores(jaxpr: jax_core.Jaxpr) -> bool:
  """Whether `jaxpr`, or a jaxpr nested in it, has a semaphore operation."""
  for eqn in jaxpr.eqns:
    if eqn.primitive in _SEMAPHORE_PRIMITIVES:
      return True
    if any(uses_semaphores(sub) for sub in jax_core.jaxprs_in_params(eqn.params)):
      return True
  return False


_rewritten: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_rewrite_lock = threading.Lock()


def rewrite(jaxpr: jax_core.Jaxpr) -> jax_core.Jaxpr:
  """`jaxpr` with its semaphore equations turned into tagged `inline_mgpu` ones.

  Cached, so that every thread (which all interpret the same jaxpr object)
  sees the same semaphore ids.
  """
  if not any(eqn.primitive in _SEMAPHORE_PRIMITIVES for eqn in jaxpr.eqns):
    return jaxpr
  with _rewrite_lock:
    if (done := _rewritten.get(jaxpr)) is not None:
      return done
    eqns = []
    for eqn in jaxpr.eqns:
      if eqn.primitive not in _SEMAPHORE_PRIMITIVES:
        eqns.append(eqn)
        continue
      if eqn.primitive is pallas_primitives.get_global_p:
        first_id = semaphores.new_semaphore_ids(
            int(np.prod(eqn.params["what"].shape)), source_info_util.summarize(eqn.source_info))
        op = SemaphoreOp("get_global", eqn.params, first_id)
      elif eqn.primitive in _SIGNAL_PRIMITIVES:
        op = SemaphoreOp("signal", eqn.params)
      elif eqn.primitive in _WAIT_PRIMITIVES:
        op = SemaphoreOp("wait", eqn.params)
      else:
        op = SemaphoreOp("read", eqn.params)
      eqns.append(eqn.replace(primitive=gpu_primitives.inline_mgpu_p, params={OP_PARAM: op}))
    done = jaxpr.replace(eqns=eqns)
    _rewritten[jaxpr] = done
    return done


def _select_semaphore(ids, transforms):
  """The id of the one semaphore that `ids` (a semaphore array) `transforms` select."""
  for transform in transforms:
    if not isinstance(transform, indexing.NDIndexer):
      raise NotImplementedError(f"Unsupported transform of a semaphore ref: {transform}")
    axis = 0
    for index in transform.indices:
      if isinstance(index, indexing.Slice):
        if index.stride != 1:
          raise NotImplementedError(f"Strided slice of a semaphore array: {transform}")
        ids = lax.dynamic_slice_in_dim(ids, index.start, index.size, axis)
        axis += 1
      else:
        ids = jnp.take(ids, jnp.asarray(index), axis=axis)
  if ids.size != 1:
    raise ValueError(f"A semaphore operation needs a single semaphore, got shape {ids.shape}")
  return ids.reshape(())


def interpret_semaphore_op(interpreter, eqn, op: SemaphoreOp, token, invals):
  """Interprets a rewritten equation: `(token, outvals)`, as the interpreter's cases return.

  `interpreter` is the interpreter's `JaxprInterpreter` of the simulated
  thread (its device, mesh location and thread).
  """
  where = source_info_util.summarize(eqn.source_info)
  if op.kind == "get_global":
    what = op.original_params["what"]
    ids = jnp.arange(int(np.prod(what.shape)), dtype=jnp.int32) + op.first_id
    return token, [ids.reshape(what.shape)]
  device_info = interpreter.device_info
  common = dict(token=token, mesh_location=interpreter.mesh_location, thread=interpreter.thread)
  args_tree = op.original_params["args_tree"]
  if op.kind == "signal":
    sem, transforms, inc, device_id, core_index = jax.tree.unflatten(args_tree, invals)
    if core_index is not None:
      raise NotImplementedError("Mosaic GPU has no cores; `core_index` must be None.")
    if device_id is None:
      target = device_info.device_id
    else:
      target = interpret_utils._device_id_to_logical(  # noqa: SLF001
          device_id, op.original_params["device_id_type"],
          device_info.axis_sizes, device_info.axis_indices)
    token = callback.io_callback(
        functools.partial(semaphores.signal, where=where), gpu_callbacks.TOKEN_SHAPE_DTYPE,
        sem_id=_select_semaphore(sem, transforms), inc=jnp.asarray(inc, jnp.int32),
        target=jnp.asarray(target, jnp.int32), num_devices=device_info.num_devices,
        **common)
    return token, []
  if op.kind == "wait":
    sem, transforms, value, decrement = jax.tree.unflatten(args_tree, invals)
    if isinstance(decrement, jax_core.Tracer):
      raise NotImplementedError("`decrement` of `semaphore_wait` must be a Python bool.")
    token = callback.io_callback(
        functools.partial(semaphores.wait, where=where, decrement=bool(decrement),
                          timeout_s=semaphores.wait_timeout_s.get()),
        gpu_callbacks.TOKEN_SHAPE_DTYPE,
        sem_id=_select_semaphore(sem, transforms), value=jnp.asarray(value, jnp.int32),
        **common)
    return token, []
  sem, transforms = jax.tree.unflatten(args_tree, invals)
  token, count = callback.io_callback(
      semaphores.read, (gpu_callbacks.TOKEN_SHAPE_DTYPE, jax.ShapeDtypeStruct((), jnp.int32)),
      sem_id=_select_semaphore(sem, transforms), **common)
  return token, [count]
