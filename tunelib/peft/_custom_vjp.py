"""`jax.custom_vjp` functions inside `lora(fn)`.

Quax (0.4.6) traces custom-JVP functions but not custom-VJP ones: a `jax.custom_vjp` call
inside a quaxified function raises `NotImplementedError`, although models and losses use them
(tunelib's fused log-prob head, flash-attention kernels). This module gives Quax's trace the
rule it lacks: the custom-VJP function is bound one level up, on plain arrays, so its forward
and backward rules run unchanged. Inputs that are Quax values (a `LoraWeight` passed straight
into such a function) are materialised first, with the usual `MaterializationWarning` for
adapted weights. Correct for every input; memory-efficient when only plain arrays (hidden
states, a dense unembedding) enter the custom-VJP function, which is the case for the fused
log-prob head with LoRA on the attention and MLP projections.
"""

import jax
import jax._src.core as core
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


def install() -> None:
    """Give Quax's trace a custom-VJP rule unless it already has one of its own."""
    trace = _trace._QuaxTrace
    if trace.process_custom_vjp_call is core.Trace.process_custom_vjp_call:
        trace.process_custom_vjp_call = _process_custom_vjp_call
