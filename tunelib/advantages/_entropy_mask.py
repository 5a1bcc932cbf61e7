r"""Token masks from the policy's entropy: training on the high-entropy "forking" tokens."""

from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar

Selection = Literal["top_k", "quantile"]
_SELECTIONS: tuple[str, ...] = Selection.__args__


def high_entropy_mask(
    entropy: Float[ArrayLike, "B T"],
    *,
    rho: Scalar = 0.2,
    selection: Selection = "top_k",
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Bool[Array, "B T"]:
    r"""Select the valid tokens whose entropy is among the top $\rho$ fraction of the batch.

    $$
    m'_{i,t} = m_{i,t} \, \mathbb{1}\big[H_{i,t} \text{ is among the } k
    \text{ largest valid entropies}\big], \qquad k = \lceil \rho \, n \rceil,
    \quad n = \textstyle\sum_{i,t} m_{i,t}
    $$

    with $H$ = `entropy`, $m$ = `where` and $\rho$ = `rho`. Wang et al. (2025) train only on
    these "forking" tokens, $\rho = 0.2$ of the tokens in each batch. Masked tokens are never
    selected. The ranking runs over the whole `[B, T]` array passed (under `jax.jit` with a
    sharded array that is the global batch); micro-batches that are ranked separately select
    differently.

    How the mask enters the loss decides the denominators, and the two ways differ:

    * As the `where` of `aggregate`: the selected tokens alone are the data, so each
      sequence's mean (``"seq_mean_token_mean"``) runs over its selected tokens, a token mean
      over the selected tokens of the batch, and a sequence without a selected token drops
      out of the sequence count.
    * TRL (1.16, `top_entropy_quantile`): the per-token loss is multiplied by the mask and
      reduced with the completion mask's denominators, so an unselected token adds 0 to the
      numerator but still counts in its sequence's length and in the token count. The exact
      call, with `mask` this function's result and `completion` the completion mask:
      ``aggregate(jnp.where(mask, per_token, 0.0), mode=..., where=completion)``, with the
      mode (and ``empty_rows="count"``) that matches TRL's `loss_type` (see `aggregate`), and
      ``selection="quantile"``, ``rho=top_entropy_quantile``.

    With ``"seq_mean_token_mean"`` the first gives each selected token of a sequence with
    $k$ of them the weight $1/k$, TRL's $1/|o_i|$: sequences with few forking tokens weigh
    more in the first.

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
      where: `[B, T]` mask, True (or 1) = a completion token that may be selected.

    Returns:
      `[B, T]` boolean mask, True = selected.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import high_entropy_mask
      >>> entropy = jnp.array([[0.1, 2.0, 0.3, 1.5, 0.2], [0.9, 0.0, 3.0, 0.5, 9.0]])
      >>> where = jnp.array([[True] * 5, [True] * 4 + [False]])  # 9 valid tokens, k = 2
      >>> mask = high_entropy_mask(entropy, rho=0.2, where=where)
      >>> print(mask.astype(int))
      [[0 1 0 0 0]
       [0 0 1 0 0]]
      >>> from tunelib.losses import aggregate
      >>> per_token = jnp.ones((2, 5))
      >>> print(aggregate(per_token, mode="seq_mean_token_mean", where=mask).mean())
      1.0
      >>> trl = aggregate(
      ...     jnp.where(mask, per_token, 0.0), mode="seq_mean_token_mean", empty_rows="count",
      ...     where=where,
      ... )
      >>> print(trl.mean())  # (1/5 + 1/4) / 2
      0.225

    This function was `tunelib.losses.high_entropy_mask`, which still works until tunelib
    0.3.0, with a `DeprecationWarning`.

    References:
      Wang et al., "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
      Reinforcement Learning for LLM Reasoning", 2025, https://arxiv.org/abs/2506.01939.
    """
    v.one_of(selection, "selection", _SELECTIONS)
    v.unit_interval(rho, "rho")
    (entropy,), where = v.masked_floats(where, ndim=2, entropy=entropy)
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
