r"""Entropy terms for policy optimisation: the entropy bonus, high-entropy token selection and
entropy diagnostics.

Every function takes per-token entropies $H_t$ of the current policy's next-token distribution,
from `tunelib.logprobs.token_entropy`, as a `[B, T]` array.
"""

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float

from tunelib import _validation as v
from tunelib._typing import Scalar

Selection = Literal["top_k", "quantile"]
_SELECTIONS: tuple[str, ...] = Selection.__args__


def _entropy_array(entropy: ArrayLike, where: ArrayLike | None) -> tuple[jax.Array, jax.Array]:
    """Checked `[B, T]` entropies in the compute dtype, zero where masked, and the mask."""
    entropy = v.float_array(entropy, "entropy")
    if entropy.ndim != 2:
        raise ValueError(f"entropy must have shape [B, T], got shape {tuple(entropy.shape)}.")
    where = v.mask_array(where, entropy.shape)
    return jnp.where(where, entropy.astype(v.compute_dtype(entropy.dtype)), 0.0), where


def entropy_bonus(
    entropy: Float[ArrayLike, "B T"],
    *,
    coefficient: Scalar,
    where: Bool[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Per-token entropy bonus as a loss term: minimising it raises the policy's entropy.

    $$
    \ell_t = -c \, H_t
    $$

    with $H_t$ = `entropy` (differentiable, from `tunelib.logprobs.token_entropy` of the
    current policy's logits) and $c$ = `coefficient`. PPO (Schulman et al. 2017, eq. 9) adds
    $c_2 H$ to the objective with $c_2 = 0.01$ on Atari; LLM recipes mostly use 0 to $10^{-3}$
    (verl's ``entropy_coeff``). Reduce it with the same `aggregate` mode as the policy loss and
    add it to that loss. A negative coefficient minimises entropy instead.

    Args:
      entropy: `[B, T]` per-token entropies in nats.
      coefficient: $c$, the weight of the bonus; may be traced (for a schedule).
      where: `[B, T]` boolean mask, True = a completion token that counts. Masked tokens give
        exactly 0 and a zero gradient, even when their entropies are NaN or infinite.

    Returns:
      `[B, T]` per-token loss terms, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import entropy_bonus
      >>> entropy = jnp.array([[0.5, 2.0, 1.0]])
      >>> print(entropy_bonus(entropy, coefficient=0.01, where=jnp.array([[True, True, False]])))
      [[-0.005 -0.02   0.   ]]

    References:
      Schulman et al., "Proximal Policy Optimization Algorithms", 2017,
      https://arxiv.org/abs/1707.06347.
    """
    entropy, where = _entropy_array(entropy, where)
    return jnp.where(where, -jnp.asarray(coefficient, entropy.dtype) * entropy, 0.0)


def high_entropy_mask(
    entropy: Float[ArrayLike, "B T"],
    *,
    rho: Scalar = 0.2,
    selection: Selection = "top_k",
    where: Bool[ArrayLike, "B T"] | None = None,
) -> Bool[Array, "B T"]:
    r"""Select the valid tokens whose entropy is among the top $\rho$ fraction of the batch.

    $$
    m'_{i,t} = m_{i,t} \, \mathbb{1}\big[H_{i,t} \text{ is among the } k
    \text{ largest valid entropies}\big], \qquad k = \lceil \rho \, n \rceil,
    \quad n = \textstyle\sum_{i,t} m_{i,t}
    $$

    with $H$ = `entropy`, $m$ = `where` and $\rho$ = `rho`. Wang et al. (2025) train only on
    these "forking" tokens, $\rho = 0.2$ of the tokens in each batch: pass the result as the
    `where` of the policy loss and of `aggregate`. Masked tokens are never selected. The
    ranking runs over the whole `[B, T]` array passed (under `jax.jit` with a sharded array
    that is the global batch); micro-batches that are ranked separately select differently.

    The two conventions, `selection`:

    * ``"top_k"`` (default; the authors' code): exactly $k = \lceil \rho n \rceil$ tokens, ties
      broken towards the earlier token in row-major (`[B, T]` flattened) order. $\rho n$ is
      rounded down to an integer when it lies within a relative $4\epsilon$ of one ($\epsilon$
      the machine epsilon, absolute at most 1/2), so that float rounding of $\rho$ (0.2 is not
      exact in binary) cannot add a token: $\rho = 0.2$, $n = 10$ gives 2. $\rho = 0$ selects
      nothing (the authors' code keeps at least one token), $\rho = 1$ every valid token.
    * ``"quantile"`` (TRL's ``top_entropy_quantile``): the tokens with $H \ge q$, $q$ the
      $(1 - \rho)$-quantile of the valid entropies with linear interpolation (NumPy's and
      PyTorch's default), computed in the compute dtype. With distinct entropies this keeps
      $1 + \lfloor \rho (n - 1) \rfloor$ tokens (the maximum even at $\rho = 0$); every token
      tied with the threshold is kept.

    Args:
      entropy: `[B, T]` per-token entropies; must be finite at valid tokens. No gradient flows
        through the mask.
      rho: $\rho \in [0, 1]$, the fraction to keep; may be traced (a traced value is clipped to
        $[0, 1]$), so scheduling it does not recompile.
      selection: ``"top_k"`` or ``"quantile"``, see above.
      where: `[B, T]` boolean mask, True = a completion token that may be selected.

    Returns:
      `[B, T]` boolean mask, True = selected.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import high_entropy_mask
      >>> entropy = jnp.array([[0.1, 2.0, 0.3, 1.5, 0.2], [0.9, 0.0, 3.0, 0.5, 9.0]])
      >>> where = jnp.array([[True] * 5, [True] * 4 + [False]])  # 9 valid tokens, k = 2
      >>> print(high_entropy_mask(entropy, rho=0.2, where=where).astype(int))
      [[0 1 0 0 0]
       [0 0 1 0 0]]

    References:
      Wang et al., "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
      Reinforcement Learning for LLM Reasoning", 2025, https://arxiv.org/abs/2506.01939.
    """
    if selection not in _SELECTIONS:
        raise ValueError(f"selection must be one of {_SELECTIONS}, got {selection!r}.")
    v.unit_interval(rho, "rho")
    entropy, where = _entropy_array(entropy, where)
    dtype = entropy.dtype
    flat, valid = entropy.ravel(), where.ravel()
    invalid = (~valid).astype(jnp.int32)
    count = jnp.sum(valid).astype(dtype)
    fraction = jnp.clip(jnp.asarray(rho, dtype), 0.0, 1.0)
    if selection == "top_k":
        slack = jnp.minimum(4 * jnp.finfo(dtype).eps * count, 0.5)
        k = jnp.ceil(fraction * count - slack)
        # Valid tokens first, by decreasing entropy; the stable sort keeps ties in order.
        positions = jnp.arange(flat.size)
        *_, order = jax.lax.sort((invalid, -flat, positions), num_keys=2, is_stable=True)
        selected = jnp.zeros(flat.size, jnp.bool_).at[order].set(positions < k)
        return (selected & valid).reshape(where.shape)
    _, ascending = jax.lax.sort((invalid, flat), num_keys=2)
    position = jnp.maximum((1 - fraction) * (count - 1), 0.0)
    low = jnp.floor(position).astype(jnp.int32)
    high = jnp.minimum(low + 1, jnp.maximum(count.astype(jnp.int32) - 1, 0))
    threshold = ascending[low] + (position - low) * (ascending[high] - ascending[low])
    return where & (entropy >= threshold)


class EntropyStatistics(NamedTuple):
    """Mean, minimum and maximum of the entropy over the valid tokens (all 0 when none)."""

    mean: jax.Array
    min: jax.Array
    max: jax.Array


def entropy_statistics(
    entropy: Float[ArrayLike, "B T"], *, where: Bool[ArrayLike, "B T"] | None = None
) -> EntropyStatistics:
    r"""Mean, minimum and maximum of the per-token entropy over the valid tokens.

    $$
    \bar H = \frac{\sum_{i,t} m_{i,t} H_{i,t}}{\sum_{i,t} m_{i,t}}, \qquad
    \min_{m_{i,t}} H_{i,t}, \qquad \max_{m_{i,t}} H_{i,t}
    $$

    with $H$ = `entropy` and $m$ = `where`: the statistics RL trainers log to watch for
    entropy collapse. A fully masked batch gives 0 for all three (not NaN or $\pm\infty$).
    The mean weighs every valid token alike (the ``"token_mean"`` mode of `aggregate`, which
    gives the numerator and denominator for an exact mean over micro-batches).

    Args:
      entropy: `[B, T]` per-token entropies.
      where: `[B, T]` boolean mask, True = counts; masked entries are ignored, even when NaN.

    Returns:
      `EntropyStatistics(mean, min, max)` of float32 scalars (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import entropy_statistics
      >>> entropy = jnp.array([[0.5, 2.0, jnp.nan], [1.0, 0.25, 0.0]])
      >>> where = jnp.array([[True, True, False], [True, True, False]])
      >>> stats = entropy_statistics(entropy, where=where)
      >>> print(stats.mean, stats.min, stats.max)
      0.9375 0.25 2.0
    """
    entropy, where = _entropy_array(entropy, where)
    count = jnp.sum(where)
    any_valid = count > 0
    mean = jnp.sum(entropy) / jnp.maximum(count, 1).astype(entropy.dtype)
    low = jnp.min(jnp.where(where, entropy, jnp.inf))
    high = jnp.max(jnp.where(where, entropy, -jnp.inf))
    return EntropyStatistics(
        mean=mean,
        min=jnp.where(any_valid, low, 0.0),
        max=jnp.where(any_valid, high, 0.0),
    )
