r"""LoRA adapters as their own pytree: creation, merge and unmerge."""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import quax
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PyTree

from tunelib._validation import compute_dtype
from tunelib.peft._rules import LoraRule, array_keys, array_leaves, match_rules, path_string


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    r"""The low-rank update $s\,AB$ of one weight `[..., d_0, d_1]`.

    A pytree whose leaves are `a` and `b`; the rest is static metadata, so an Optax state,
    an Orbax checkpoint or a `jax.grad` of adapters has the same structure.

    Attributes:
      a: $A$, `[..., d_0, r]`.
      b: $B$, `[..., r, d_1]`.
      alpha: $\alpha$.
      rslora: whether $s = \alpha / \sqrt r$ (rsLoRA) instead of $\alpha / r$.
      dropout: dropout probability on the adapter's input.
      layout: "in_out" (the weight is used as `x @ W`) or "out_in" (`x @ W.T`).
    """

    # Untyped: pytree operations (labels, abstract templates) put other leaves here.
    a: Any
    b: Any
    alpha: float = dataclasses.field(metadata={"static": True}, default=8.0)
    rslora: bool = dataclasses.field(metadata={"static": True}, default=False)
    dropout: float = dataclasses.field(metadata={"static": True}, default=0.0)
    layout: str = dataclasses.field(metadata={"static": True}, default="in_out")

    @property
    def rank(self) -> int:
        return self.a.shape[-1]

    @property
    def scale(self) -> float:
        """$s = \\alpha / r$, or $\\alpha / \\sqrt r$ with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def delta(self, dtype: DTypeLike | None = None) -> Float[Array, "*S d0 d1"]:
        """$s\\,AB$ in `dtype`; by default at least float32 (float64 for float64 factors)."""
        dtype = compute_dtype(self.a.dtype, self.b.dtype) if dtype is None else dtype
        return self.scale * (self.a.astype(dtype) @ self.b.astype(dtype))


def init_lora(
    params: PyTree,
    rules: Sequence[LoraRule],
    *,
    key: jax.Array,
    dtype: DTypeLike = jnp.float32,
    allow_unmatched: bool = False,
) -> dict:
    r"""Adapters for the weights of `params` that `rules` select, as a nested dict.

    The result mirrors the nesting of `params` but holds only the selected paths, each a
    `LoraAdapter`: the factor that sees the input drawn as the rule's `init` says, the other
    zero, so $W + s\,AB = W$ at the start. A weight with leading axes `[..., d_0, d_1]`
    (stacked layers) gets independent adapters per leading index.

    Args:
      params: the base parameters (any pytree of arrays, quantised tensors included, such
        as `nnx.to_pure_dict(nnx.state(model))`).
      rules: `LoraRule`s; the first whose pattern matches a path wins.
      key: the PRNG key the random factors are drawn from (one fold per path).
      dtype: the adapters' dtype (float32 master weights by default).
      allow_unmatched: warn (`UnmatchedRuleWarning`) instead of raising when a rule selects
        nothing.

    Returns:
      A nested dict of `LoraAdapter`s keyed like `params`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from tunelib import peft
      >>> params = {"layer": {"w": jnp.ones((16, 32)), "bias": jnp.zeros(32)}}
      >>> adapters = peft.init_lora(params, [peft.LoraRule(pattern="layer/w", rank=4,
      ...                                                  alpha=8)], key=jax.random.key(0))
      >>> lora = adapters["layer"]["w"]
      >>> print(lora.a.shape, lora.b.shape, lora.scale, float(jnp.abs(lora.b).max()))
      (16, 4) (4, 32) 2.0 0.0
      >>> print(bool(jnp.abs(lora.a).max() <= 1 / 16**0.5))  # U(-1/sqrt(fan_in), ...)
      True
    """
    rules = tuple(rules)
    for rule in rules:
        if not isinstance(rule, LoraRule):
            raise TypeError(f"rules must be LoraRule instances, got {rule!r}.")
    selected = match_rules(
        params, [r.pattern for r in rules], allow_unmatched=allow_unmatched, what="LoRA rule"
    )
    keys = array_keys(params)
    out: dict = {}
    for n, (path, (index, leaf)) in enumerate(selected.items()):
        rule = rules[index]
        adapter = _new_adapter(leaf.shape, rule, jax.random.fold_in(key, n), jnp.dtype(dtype))
        set_nested(out, keys[path], adapter)
    return out


def _new_adapter(shape: tuple[int, ...], rule: LoraRule, key: jax.Array, dtype) -> LoraAdapter:
    *lead, d0, d1 = shape
    r = rule.rank
    # The factor applied to the input first: A [d0, r] for x @ W, B [r, d1] for x @ W.T.
    fan_in = d0 if rule.layout == "in_out" else d1
    random_shape = (*lead, d0, r) if rule.layout == "in_out" else (*lead, r, d1)
    if rule.init == "kaiming":
        bound = 1.0 / math.sqrt(fan_in)
        first = jax.random.uniform(key, random_shape, jnp.float32, -bound, bound)
    else:
        first = jax.random.normal(key, random_shape, jnp.float32) / r
    first = first.astype(dtype)
    if rule.layout == "in_out":
        a, b = first, jnp.zeros((*lead, r, d1), dtype)
    else:
        a, b = jnp.zeros((*lead, d0, r), dtype), first
    return LoraAdapter(
        a=a,
        b=b,
        alpha=float(rule.alpha),
        rslora=rule.scaling == "rslora",
        dropout=float(rule.dropout),
        layout=rule.layout,
    )


def set_nested(tree: dict, keys: tuple, value: Any) -> None:
    """`tree[k0][k1]...[kn] = value`, creating the dicts on the way."""
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def adapter_leaves(adapters: PyTree) -> dict[str, LoraAdapter]:
    """Every `LoraAdapter` of `adapters` by the path string of the weight it adapts."""
    leaves = jax.tree_util.tree_leaves_with_path(
        adapters, is_leaf=lambda x: isinstance(x, LoraAdapter)
    )
    out = {}
    for path, leaf in leaves:
        if not isinstance(leaf, LoraAdapter):
            raise TypeError(
                f"adapters must hold only LoraAdapter nodes, got {type(leaf).__name__} at "
                f"{path_string(path)!r}."
            )
        out[path_string(path)] = leaf
    return out


def check_adapters(params: PyTree, adapters: PyTree) -> dict[str, LoraAdapter]:
    """`adapter_leaves(adapters)` after checking each against the weight it adapts."""
    weights = array_leaves(params)
    found = adapter_leaves(adapters)
    for path, adapter in found.items():
        if path not in weights:
            raise ValueError(f"adapters has an adapter for {path!r}, which params does not have.")
        shape = tuple(weights[path].shape)
        a, b = adapter.a.shape, adapter.b.shape
        want_a, want_b = (*shape[:-1], adapter.rank), (*shape[:-2], adapter.rank, shape[-1])
        if len(shape) < 2 or tuple(a) != want_a or tuple(b) != want_b:
            raise ValueError(
                f"the adapter of {path!r} has a {tuple(a)} and b {tuple(b)}, which do not fit "
                f"the weight's shape {shape}: expected {want_a} and {want_b}."
            )
    return found


def _replace(params: PyTree, adapters: PyTree, fn) -> PyTree:
    found = check_adapters(params, adapters)

    def visit(path, leaf):
        adapter = found.get(path_string(path))
        return leaf if adapter is None else fn(leaf, adapter)

    return jax.tree_util.tree_map_with_path(
        visit, params, is_leaf=lambda x: isinstance(x, quax.ArrayValue)
    )


def _dense(weight, adapter: LoraAdapter) -> tuple[jax.Array, jnp.dtype]:
    """The weight in the dtype its sum with the adapter is computed in, and its own dtype."""
    dtype = compute_dtype(weight.dtype, adapter.a.dtype, adapter.b.dtype)
    if isinstance(weight, quax.ArrayValue):
        return weight.dequantize(dtype), weight.dtype
    return weight.astype(dtype), weight.dtype


def merge_lora(params: PyTree, adapters: PyTree) -> PyTree:
    r"""The parameters with every adapter folded in: $W \leftarrow W + s\,AB$.

    The sum is computed in float32 (float64 when weight or adapter is float64) and cast to the
    weight's dtype; a quantised base weight is dequantised first, so the merged weight is
    dense. Use it to export a fine-tuned model or
    to hand plain weights to a sampler.

    Args:
      params: the base parameters.
      adapters: the `init_lora` adapters (trained).

    Returns:
      `params` with the adapted leaves replaced by dense merged weights.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from tunelib import peft
      >>> params = {"w": jnp.zeros((3, 2))}
      >>> adapters = {"w": peft.LoraAdapter(a=jnp.ones((3, 1)), b=jnp.ones((1, 2)), alpha=2.0)}
      >>> print(peft.merge_lora(params, adapters)["w"])
      [[2. 2.]
       [2. 2.]
       [2. 2.]]
    """

    def merge(weight, adapter):
        dense, dtype = _dense(weight, adapter)
        return (dense + adapter.delta(dense.dtype)).astype(dtype)

    return _replace(params, adapters, merge)


def unmerge_lora(merged: PyTree, adapters: PyTree) -> PyTree:
    r"""The inverse of `merge_lora` on dense weights: $W \leftarrow W - s\,AB$ (same dtypes)."""

    def unmerge(weight, adapter):
        if isinstance(weight, quax.ArrayValue):
            raise TypeError("unmerge_lora takes merged (dense) weights, not quantised tensors.")
        dense, dtype = _dense(weight, adapter)
        return (dense - adapter.delta(dense.dtype)).astype(dtype)

    return _replace(merged, adapters, unmerge)
