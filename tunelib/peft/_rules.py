"""Which weights get an adapter (or are quantised): regular expressions over parameter paths."""

import dataclasses
import re
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import quax
from jaxtyping import PyTree

Scaling = Literal["standard", "rslora"]
Init = Literal["kaiming", "gaussian"]
Layout = Literal["in_out", "out_in"]


class UnmatchedRuleWarning(UserWarning):
    """A rule selected no parameter; raised as an error unless unmatched rules are allowed.

    Turn the warning back into an error with
    `warnings.simplefilter("error", UnmatchedRuleWarning)`.
    """


def path_string(path: tuple) -> str:
    """A pytree key path as the `/`-joined string rules match: `layers/0/mlp/up_proj/kernel`."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def keyed_leaves(tree: PyTree, is_leaf=None) -> dict[str, tuple[tuple, Any]]:
    """Every leaf of `tree` by path string, with the keys (dict keys, sequence indices,
    attribute names) that reach it, in pytree order."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)
    return {
        path_string(path): (
            tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path),
            leaf,
        )
        for path, leaf in leaves
    }


def array_leaves(params: PyTree) -> dict[str, Any]:
    """Every array of `params` (quantised tensors whole) by path string, in pytree order."""
    leaves = keyed_leaves(params, is_leaf=lambda x: isinstance(x, quax.ArrayValue))
    return {path: leaf for path, (_, leaf) in leaves.items()}


def array_keys(params: PyTree) -> dict[str, tuple]:
    """The keys that reach every array of `params` (quantised tensors whole), by path string."""
    leaves = keyed_leaves(params, is_leaf=lambda x: isinstance(x, quax.ArrayValue))
    return {path: keys for path, (keys, _) in leaves.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraRule:
    r"""Where to put a LoRA adapter and how: the weights whose path matches `pattern`.

    The adapted weight is $W + s\,AB$ with $A$ `[..., d_0, r]`, $B$ `[..., r, d_1]` for a
    weight `[..., d_0, d_1]` (leading axes, such as stacked layers, get one adapter each),
    and $s = \alpha / r$ (or $\alpha / \sqrt r$, rsLoRA).

    Attributes:
      pattern: a regular expression that must match the whole `/`-joined parameter path
        (`re.fullmatch`, as PEFT matches a string `target_modules`), for example
        `r"layers/\d+/self_attn/(q|v)_proj/kernel"` or `r".*_proj/kernel"`. With several
        rules the first that matches a path wins.
      rank: $r$.
      alpha: $\alpha$ (PEFT's `lora_alpha`).
      dropout: the probability of zeroing an element of the adapter's input (the base
        weight always sees the undropped input, as in PEFT).
      scaling: "standard" ($\alpha / r$, Hu et al. and PEFT's default) or "rslora"
        ($\alpha / \sqrt r$, Kalajdzievski 2023; PEFT's `use_rslora`).
      init: "kaiming" (PEFT's default: the factor that sees the input is drawn from
        $U(-1/\sqrt{d_{in}}, 1/\sqrt{d_{in}})$, PyTorch's `kaiming_uniform_` with
        $a = \sqrt 5$) or "gaussian" ($N(0, 1/r)$, PEFT's `init_lora_weights="gaussian"`);
        the other factor is zero, so the adapted model starts equal to the base.
      layout: how the weight is applied: "in_out" (`x @ W`, the JAX and Flax convention:
        $d_0$ is the input axis, $A$ sees the input) or "out_in" (`x @ W.T`, PyTorch's
        `[out, in]` layout: $B$ sees the input). It sets which factor is random and how
        adapters export to PEFT; the forward pass handles either.
    """

    pattern: str
    rank: int = 8
    alpha: float | int = 8.0
    dropout: float | int = 0.0
    scaling: Scaling = "standard"
    init: Init = "kaiming"
    layout: Layout = "in_out"

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise TypeError(f"pattern must be a str, got {self.pattern!r}.")
        try:
            re.compile(self.pattern)
        except re.error as error:
            raise ValueError(f"pattern {self.pattern!r} is not a valid regex: {error}.") from None
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {self.rank!r}.")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float):
            raise TypeError(f"alpha must be a number, got {self.alpha!r}.")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}.")
        if not (isinstance(self.dropout, int | float) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout!r}.")
        for name, allowed in (
            ("scaling", Scaling.__args__),
            ("init", Init.__args__),
            ("layout", Layout.__args__),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")


def match_rules(
    params: PyTree,
    patterns: Sequence[str],
    *,
    allow_unmatched: bool = False,
    what: str = "rule",
) -> dict[str, tuple[int, Any]]:
    """The leaves each pattern selects: `{path: (index of the first matching pattern, leaf)}`.

    Only floating-point leaves of at least 2 dimensions (or quantised tensors) may be
    selected; selecting anything else is a `ValueError` naming the path. A pattern that
    selects nothing (it matches no path, or only paths an earlier pattern took) is a
    `ValueError`, or an `UnmatchedRuleWarning` with `allow_unmatched`.
    """
    if isinstance(patterns, str):
        raise TypeError(f"{what}s must be a sequence, got the single string {patterns!r}.")
    compiled = [re.compile(p) for p in patterns]
    leaves = array_leaves(params)
    selected: dict[str, tuple[int, Any]] = {}
    matched_any = [False] * len(compiled)
    for path, leaf in leaves.items():
        hits = [i for i, c in enumerate(compiled) if c.fullmatch(path)]
        for i in hits:
            matched_any[i] = True
        if not hits:
            continue
        dtype = getattr(leaf, "dtype", None)
        if len(leaf.shape) < 2 or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{what} {patterns[hits[0]]!r} selects {path!r} of shape {tuple(leaf.shape)} "
                f"and dtype {dtype}; only floating-point weights of 2 or more dimensions can "
                "be selected."
            )
        selected[path] = (hits[0], leaf)
    won = {i for i, _ in selected.values()}
    for i, pattern in enumerate(patterns):
        if i in won:
            continue
        reason = (
            "every parameter it matches is taken by an earlier one"
            if matched_any[i]
            else "it matches no parameter path"
        )
        examples = ", ".join(repr(p) for p in list(leaves)[:4])
        message = f"{what} {pattern!r} selects nothing: {reason} (paths look like {examples})."
        if not allow_unmatched:
            raise ValueError(message)
        warnings.warn(message, UnmatchedRuleWarning, stacklevel=3)
    return selected
