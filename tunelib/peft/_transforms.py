"""Two JAX transformations that Quax (0.4.6) does not carry through: custom VJPs and remat.

A `jax.custom_vjp` call inside a quaxified function raises `NotImplementedError`, and a
`jax.checkpoint` (remat) region has no Quax rule, so every Quax value entering it would be
materialised. Models and losses use both (tunelib's fused log-prob head; the decoder's
`remat=True`). This module supplies the two rules:

- custom VJP: the function is bound one level up, on plain arrays, so its forward and
  backward rules run unchanged. Quax values entering it (a `LoraWeight` passed straight into
  one) are materialised first, with the usual `MaterializationWarning` for adapted weights.
  Memory-efficient when only plain arrays enter, as with the fused log-prob head and LoRA on
  the attention and MLP projections.
- remat: the region's body is quaxified and checkpointed again with the same policy, so
  adapted and quantised weights stay what they are inside it and the recomputation in the
  backward pass recomputes their products, not a merged weight.

Both reach into Quax's internals (its trace class and rule table), which is why
`pyproject.toml` pins `quax<0.5`. Nothing is installed at import: `install` runs on the first
call of a `tunelib.peft.lora`-wrapped function, once per process.
"""

import jax
import jax._src.core as core
import jax.extend.core as jexc
import jax.tree_util as jtu
import quax
from jax._src.ad_checkpoint import remat_p
from jaxtyping import ArrayLike
from quax import _trace
from quax._values import _dense, _DenseArrayValue


def _process_custom_vjp_call(
    self, primitive, fun, fwd, bwd, tracers, *, out_trees, symbolic_zeros
) -> list:
    values = [self.to_value(t) for t in tracers]
    with core.set_current_trace(self.parent_trace):
        arrays = tuple(
            v.array if type(v) is _DenseArrayValue else type(v).materialise(v) for v in values
        )
    avals = tuple(jax.typeof(x) for x in arrays)
    params = dict(subfuns=(fun, fwd, bwd), out_trees=out_trees, symbolic_zeros=symbolic_zeros)
    out = primitive.bind_with_trace(self.parent_trace, arrays, avals, params)
    return [_trace._QuaxTracer(self, _dense(x)) for x in out]


def _remat(*args: ArrayLike | quax.ArrayValue, jaxpr, prevent_cse, differentiated, policy) -> list:
    del differentiated  # set again by jax.checkpoint's own differentiation rules
    leaves, treedef = jtu.tree_flatten(args, is_leaf=lambda x: isinstance(x, quax.ArrayValue))
    body = jexc.jaxpr_as_fun(core.ClosedJaxpr(jaxpr, ()))
    flat, flat_tree = jtu.tree_flatten(leaves)

    def region(*flat):
        return quax.quaxify(body)(*jtu.tree_unflatten(treedef, jtu.tree_unflatten(flat_tree, flat)))

    return jax.checkpoint(region, prevent_cse=prevent_cse, policy=policy)(*flat)


_installed = False


def install() -> None:
    """Give Quax the two rules, once (the custom-VJP one unless its trace has its own)."""
    global _installed
    if _installed:
        return
    trace = _trace._QuaxTrace
    if trace.process_custom_vjp_call is core.Trace.process_custom_vjp_call:
        trace.process_custom_vjp_call = _process_custom_vjp_call
    quax.register(remat_p)(_remat)
    _installed = True
