"""Shardings of the decoder's parameters from the logical axis names of its weights."""

from collections.abc import Sequence

import jax
from flax import nnx
from jaxtyping import PyTree

# Megatron-style tensor parallelism over a "model" mesh axis: attention heads, MLP width and
# the vocabulary are split; the residual stream ("embed") and the stacked-layer axis are not.
TENSOR_PARALLEL_RULES: tuple[tuple[str, str | None], ...] = (
    ("layers", None),
    ("vocab", "model"),
    ("embed", None),
    ("q_heads", "model"),
    ("kv_heads", "model"),
    ("head_dim", None),
    ("mlp", "model"),
    ("experts", None),
    ("router", None),
    ("per_layer", None),
    # Qwen3.5's Gated DeltaNet projections (its heads are split after a convolution over the
    # fused q/k/v channels, so they stay whole) and its MoE's shared-expert gate.
    ("linear_qkv", None),
    ("linear_v", None),
    ("linear_heads", None),
    ("shared_gate", None),
)
# Expert parallelism over a mesh axis "expert" on top of the tensor parallelism above: each
# device holds the weights of E / (expert axis size) experts (whole, or split over "model").
EXPERT_PARALLEL_RULES: tuple[tuple[str, str | None], ...] = tuple(
    (name, "expert" if name == "experts" else axis) for name, axis in TENSOR_PARALLEL_RULES
)


def param_shardings(
    graphdef: nnx.GraphDef,
    params: PyTree,
    mesh: jax.sharding.Mesh,
    rules: Sequence[tuple[str, str | None]] = TENSOR_PARALLEL_RULES,
) -> PyTree[jax.sharding.NamedSharding]:
    """A `NamedSharding` for every parameter, from its logical axis names and `rules`.

    Every weight of `tunelib.models.Decoder` names its axes ("layers", "vocab", "embed",
    "q_heads", "kv_heads", "head_dim", "mlp", for a mixture of experts "experts" and
    "router", and for Gemma 4's per-layer inputs "per_layer"); `rules` maps each name to a
    mesh axis or None (replicated). The default, `TENSOR_PARALLEL_RULES`, splits heads, MLP
    width and vocabulary over a mesh axis "model"; `EXPERT_PARALLEL_RULES` also splits the
    experts over a mesh axis "expert". Place parameters with
    `jax.device_put(params, param_shardings(...))`.

    Args:
      graphdef: the model's `nnx.GraphDef`.
      params: its parameters, an `nnx.State` or the pure dict of one (only the structure and
        the graph's metadata are read).
      mesh: the target mesh; every mesh axis a rule names must exist in it.
      rules: `(logical name, mesh axis or None)` pairs covering every logical name.

    Returns:
      A pytree of the same structure as `params` (a pure dict when `params` is one) of
      `jax.sharding.NamedSharding`.

    Examples:
      >>> import jax
      >>> from flax import nnx
      >>> from tunelib.models import Decoder, DecoderConfig, param_shardings
      >>> cfg = DecoderConfig(vocab_size=16, hidden_size=32, intermediate_size=64,
      ...                     num_hidden_layers=1, num_attention_heads=2, head_dim=16)
      >>> graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
      >>> mesh = jax.make_mesh((1, 1), ("data", "model"))
      >>> shardings = param_shardings(graphdef, nnx.to_pure_dict(params), mesh)
      >>> for path, sharding in jax.tree_util.tree_leaves_with_path(shardings):
      ...     name = jax.tree_util.keystr(path, simple=True, separator="/")
      ...     if name.startswith("layers/0/mlp"):
      ...         print(name, sharding.spec)
      layers/0/mlp/down_proj/kernel P('model', None)
      layers/0/mlp/gate_proj/kernel P(None, 'model')
      layers/0/mlp/up_proj/kernel P(None, 'model')
    """
    state = nnx.state(nnx.merge(graphdef, params))
    with nnx.logical_axis_rules(list(rules)):
        shardings = nnx.get_named_sharding(state, mesh)
    if isinstance(params, nnx.State):
        return shardings
    return nnx.to_pure_dict(shardings)
