"""Diversity of the completions sampled for one prompt: distinct completions and distinct n-grams.

Completions come flat, `[B*G, T]`, in the layout of `rollout.sample(..., group_size=G)` and
`advantages.group_advantages`: row `b * G + g` is completion `g` of prompt `b`. A completion
is the sequence of its tokens that `where` keeps, in order, wherever the padding lies.
Comparisons are exact (no hashing), so two completions or n-grams count as one only when
every token is equal.
"""

import einops
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from tunelib import _validation as v
from tunelib._typing import Mask


def _grouped(
    completions: ArrayLike, where: ArrayLike | None, group_size: int
) -> tuple[jax.Array, jax.Array]:
    """Checked completions as `[B, G, T]` token ids with their kept tokens moved to the front
    (0 after them), and the `[B, G, T]` mask of those tokens (a prefix of each row)."""
    completions = v.int_array(completions, "completions")
    if completions.ndim != 2:
        raise ValueError(
            f"completions must have shape [B*G, T] (token ids, row b * G + g completion g of "
            f"prompt b), got shape {tuple(completions.shape)}."
        )
    where = v.mask_array(where, completions.shape)
    v.static_int(group_size, "group_size", what="a Python int >= 1 (a static value)")
    v.number_in(group_size, "group_size", low=1)
    if completions.shape[0] % group_size:
        raise ValueError(
            f"completions has {completions.shape[0]} rows, which is not a multiple of "
            f"group_size={group_size}."
        )
    order = jnp.argsort(~where, axis=-1, stable=True)
    tokens = jnp.take_along_axis(jnp.where(where, completions, 0), order, axis=-1)
    kept = jnp.take_along_axis(where, order, axis=-1)
    split = "(b g) t -> b g t"
    return (
        einops.rearrange(tokens, split, g=group_size),
        einops.rearrange(kept, split, g=group_size),
    )


def distinct_completions(
    completions: Int[ArrayLike, "BG T"],
    *,
    group_size: int,
    where: Mask[ArrayLike, "BG T"] | None = None,
) -> Float[Array, " B"]:
    r"""The fraction of distinct completions in each group of samples of one prompt.

    $$
    d_b = \frac{\big|\{\, y_{b,g} : g \in \mathcal{V}_b \,\}\big|}{|\mathcal{V}_b|}
    $$

    with $y_{b,g}$ completion $g$ of prompt $b$ in `completions` (its tokens that `where`
    keeps) and $\mathcal{V}_b$ the completions of the group with at least one kept token: 1
    when every sample differs, $1 / G$ when all $G$ are the same, the collapse that
    pass@k and entropy watch for from other sides. Rows without a kept token are not
    completions; a group without any gives 0. The comparison is exact, token by token
    (pairwise within a group, $O(G^2 T)$).

    Args:
      completions: `[B*G, T]` integer token ids; values under a False `where` are ignored.
      group_size: $G$, the completions per prompt, a Python int >= 1 (static).
      where: `[B*G, T]` mask of the completion tokens, True (or 1) = counts; None = all.

    Returns:
      `[B]` float32 fractions in $[0, 1]$, one per group.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import distinct_completions
      >>> completions = jnp.array([[5, 6, 0], [5, 6, 7], [5, 6, 0], [1, 2, 3]])
      >>> where = jnp.array([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
      >>> print(distinct_completions(completions, group_size=2, where=where))
      [1. 1.]
      >>> print(distinct_completions(completions, group_size=4, where=where))
      [0.75]
    """
    tokens, kept = _grouped(completions, where, group_size)
    present = jnp.any(kept, axis=-1)
    same = jnp.all(
        (tokens[:, :, None] == tokens[:, None, :]) & (kept[:, :, None] == kept[:, None, :]),
        axis=-1,
    )
    earlier = jnp.tril(jnp.ones((group_size, group_size), bool), k=-1)  # [g, h]: h < g
    repeated = jnp.any(same & earlier & present[:, None, :], axis=-1)
    distinct = jnp.sum(present & ~repeated, axis=-1)
    count = jnp.sum(present, axis=-1)
    return (distinct / jnp.maximum(count, 1)).astype(jnp.float32)


def distinct_ngrams(
    completions: Int[ArrayLike, "BG T"],
    *,
    n: int,
    group_size: int,
    where: Mask[ArrayLike, "BG T"] | None = None,
) -> Float[Array, " B"]:
    r"""Distinct-n of each group: its distinct n-grams over all its n-grams.

    $$
    \mathrm{distinct}\text{-}n_b =
    \frac{\big|\{\, (y_{b,g,t}, \dots, y_{b,g,t+n-1}) : g, t \,\}\big|}
    {\sum_g \max(L_{b,g} - n + 1, 0)}
    $$

    over the n-grams of the $G$ completions of prompt $b$ pooled together, with $y_{b,g}$
    completion $g$ in `completions` (its $L_{b,g}$ tokens that `where` keeps, in order, so an
    n-gram joins the kept tokens on either side of a dropped one). A group without an n-gram
    (every completion shorter than $n$) gives 0. The n-grams of a group are sorted
    lexicographically and counted where one differs from the previous: exact,
    $O(G T \log(G T))$ per group.

    Args:
      completions: `[B*G, T]` integer token ids; values under a False `where` are ignored.
      n: the n-gram length, a Python int >= 1 (static).
      group_size: $G$, the completions per prompt, a Python int >= 1 (static).
      where: `[B*G, T]` mask of the completion tokens, True (or 1) = counts; None = all.

    Returns:
      `[B]` float32 fractions in $[0, 1]$, one per group.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import distinct_ngrams
      >>> completions = jnp.array([[1, 2, 1, 2], [1, 2, 3, 4]])
      >>> print(distinct_ngrams(completions, n=1, group_size=2))  # 1, 2, 3, 4 of 8
      [0.5]
      >>> print(distinct_ngrams(completions, n=2, group_size=2).round(4))  # 12 21 23 34 of 6
      [0.6667]

    References:
      Li et al., "A Diversity-Promoting Objective Function for Neural Conversation Models",
      2016, https://arxiv.org/abs/1510.03055.
    """
    v.static_int(n, "n", what="a Python int >= 1 (a static value)")
    v.number_in(n, "n", low=1)
    tokens, kept = _grouped(completions, where, group_size)
    batch, _, length = tokens.shape
    if n > length:
        return jnp.zeros((batch,), jnp.float32)
    starts = length - n + 1
    grams = jnp.stack([tokens[..., j : j + starts] for j in range(n)], axis=-1)
    grams = einops.rearrange(grams, "b g t n -> b (g t) n")
    # The kept tokens are a prefix of each row, so an n-gram is whole when its last token is kept.
    whole = einops.rearrange(kept[..., n - 1 :], "b g t -> b (g t)")
    keys = [grams[..., j] for j in reversed(range(n))] + [(~whole).astype(jnp.int32)]
    order = jnp.lexsort(keys, axis=-1)  # whole n-grams first, each run of equal ones together
    grams = jnp.take_along_axis(grams, order[..., None], axis=1)
    whole = jnp.take_along_axis(whole, order, axis=1)
    new = jnp.any(grams[:, 1:] != grams[:, :-1], axis=-1)
    new = jnp.concatenate([jnp.ones((batch, 1), bool), new], axis=1)
    distinct = jnp.sum(whole & new, axis=-1)
    return (distinct / jnp.maximum(jnp.sum(whole, axis=-1), 1)).astype(jnp.float32)
