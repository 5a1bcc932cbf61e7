"""Auxiliary losses of mixture-of-experts routers: load balancing and the router z-loss."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._typing import Mask


def load_balancing_loss(
    router_logits: Float[ArrayLike, "L *N E"],
    *,
    top_k: int,
    pool_layers: bool = True,
    normalize_by_top_k: bool = False,
    where: Mask[ArrayLike, "*N"] | None = None,
) -> Float[Array, "*L"]:
    r"""The auxiliary load-balancing loss of mixture-of-experts routers (Switch Transformer).

    $$
    \mathcal{L} = E \sum_{e=1}^{E} f_e\, P_e, \qquad
    f_e = \frac{1}{c\,|\mathcal{T}|} \sum_{t \in \mathcal{T}} \sum_{j=1}^{k}
      [\,\mathrm{expert}_j(t) = e\,], \qquad
    P_e = \frac{1}{|\mathcal{T}|} \sum_{t \in \mathcal{T}} p_{t,e}
    $$

    with $p_t = \mathrm{softmax}(z_t)$ the router probabilities of token $t$ (logits $z$ =
    `router_logits`), $\mathrm{expert}_j(t)$ its $k$ = `top_k` most probable experts, and
    $\mathcal{T}$ the tokens where `where` is True. $f$ is the fraction of routing choices
    each expert receives (no gradient flows through it), $P$ its mean probability; perfectly
    balanced routing gives $\mathcal{L} = k / c$. Switch (Fedus et al.) has $k = 1$; for
    $k > 1$ the conventions differ:

    - $c = 1$ (`normalize_by_top_k=False`, the default): `transformers`' Mixtral, Qwen2-MoE
      and Qwen3-MoE (`load_balancing_loss_func`), balanced value $k$.
    - $c = k$ (`normalize_by_top_k=True`): DeepSeek-V2's expert-level balance loss without its
      coefficient, and GShard's mean over choices, balanced value 1.

    Over the layers (the leading axis of `router_logits`) the conventions differ too:
    `pool_layers=True` (the default, as `transformers`) computes one $f$ and one $P$ from the
    tokens of all layers together and returns one value; `pool_layers=False` returns each
    layer's own loss, `[L]`, to be summed as Switch and Megatron-LM do. Scale by the
    coefficient yourself (`router_aux_loss_coef` in a Qwen3-MoE `config.json`, 1e-3 there,
    1e-2 in Switch).

    Args:
      router_logits: `[L, ..., E]` logits of $L$ router layers over the same tokens, as
        `tunelib.models.Decoder(..., return_router_logits=True)` returns them
        (`[L, B, T, E]`).
      top_k: $k$, the experts each token is routed to (static, in `[1, E]`).
      pool_layers: pool the statistics of all layers into one loss (`transformers`), or
        return one loss per layer.
      normalize_by_top_k: divide $f$ by $k$ ($c = k$).
      where: `[...]` mask over the tokens (the axes between the layer and expert axes),
        True (or 1) = counts; padding is left out of $f$ and $P$, as `transformers` leaves
        out its `attention_mask`. None means all tokens count.

    Returns:
      The loss, float32 (float64 for float64 logits): a scalar when `pool_layers`, else
      `[L]`. With no counted token it is 0.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import load_balancing_loss
      >>> balanced = jnp.log(jnp.array([[[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]]))
      >>> print(load_balancing_loss(balanced, top_k=2))  # every expert chosen once: f = 1/2
      2.0
      >>> skewed = jnp.log(jnp.array([[[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]]))
      >>> print(load_balancing_loss(skewed, top_k=2).round(4))
      2.8
      >>> print(load_balancing_loss(skewed, top_k=2, normalize_by_top_k=True).round(4))
      1.4

    References:
      Fedus, Zoph and Shazeer, "Switch Transformers: Scaling to Trillion Parameter Models
      with Simple and Efficient Sparsity", 2021, https://arxiv.org/abs/2101.03961.
      Lepikhin et al., "GShard: Scaling Giant Models with Conditional Computation and
      Automatic Sharding", 2020, https://arxiv.org/abs/2006.16668.
      DeepSeek-AI, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts
      Language Model", 2024, https://arxiv.org/abs/2405.04434.
    """
    logits = v.float_array(router_logits, "router_logits")
    if logits.ndim < 2:
        raise ValueError(
            f"router_logits must have shape [L, ..., E] (layers first), got {logits.shape}."
        )
    experts = logits.shape[-1]
    v.static_int(top_k, "top_k")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}] (the experts), got {top_k}.")
    for name, flag in (("pool_layers", pool_layers), ("normalize_by_top_k", normalize_by_top_k)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}.")
    where = v.mask_array(where, logits.shape[1:-1])
    dtype = v.compute_dtype(logits.dtype)
    probs = jax.nn.softmax(logits.astype(dtype), axis=-1)
    _, chosen = jax.lax.top_k(probs, top_k)
    weight = where.astype(dtype)[None, ..., None]  # [1, ..., 1]
    choices = jnp.sum(jax.nn.one_hot(chosen, experts, dtype=dtype), axis=-2) * weight
    probs = probs * weight
    token_axes = tuple(range(1, logits.ndim - 1))
    counts, mass = jnp.sum(choices, axis=token_axes), jnp.sum(probs, axis=token_axes)  # [L, E]
    tokens = jnp.sum(where.astype(dtype)) * jnp.ones((logits.shape[0], 1), dtype)
    if pool_layers:
        counts, mass, tokens = (jnp.sum(x, axis=0) for x in (counts, mass, tokens))
    scale = top_k if normalize_by_top_k else 1
    safe = jnp.maximum(tokens, 1)
    loss = experts * jnp.sum((counts / (scale * safe)) * (mass / safe), axis=-1)
    return jnp.where(tokens[..., 0] > 0, loss, 0.0)


def router_z_loss(
    router_logits: Float[ArrayLike, "*N E"],
    *,
    where: Mask[ArrayLike, "..."] | None = None,
) -> Float[Array, "*N"]:
    r"""The router z-loss of ST-MoE: the squared log-partition of each token's router logits.

    $$ \ell_t = \Big(\log \sum_{e=1}^{E} e^{z_{t,e}}\Big)^2 $$

    with $z$ = `router_logits`. It keeps the logits small, which ST-MoE found to stabilise
    training, especially in low precision; the paper averages it over the tokens of a batch
    and weights it by $10^{-3}$ (reduce with `tunelib.losses.aggregate`).

    Args:
      router_logits: `[..., E]` router logits (any leading axes, such as the `[L, B, T]` of
        `tunelib.models.Decoder(..., return_router_logits=True)`).
      where: `[...]` mask over the leading axes (or a suffix of them: a `[B, T]` mask for
        `[L, B, T, E]` logits), True (or 1) = counts; masked tokens give 0.

    Returns:
      `[...]` per-token values, float32 (float64 for float64 logits).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import router_z_loss
      >>> print(router_z_loss(jnp.array([[0.0, 0.0], [3.0, -1.0]])).round(4).tolist())
      [0.4805, 9.1092]

    References:
      Zoph et al., "ST-MoE: Designing Stable and Transferable Sparse Expert Models", 2022,
      https://arxiv.org/abs/2202.08906.
    """
    logits = v.float_array(router_logits, "router_logits")
    v.check_ndim(logits, "router_logits", at_least=1)
    lead = logits.shape[:-1]
    if where is None:
        where = jnp.ones(lead, jnp.bool_)
    else:
        where = v.mask_like(where, "where")
        if where.ndim > len(lead) or lead[len(lead) - where.ndim :] != where.shape:
            raise ValueError(
                f"where {where.shape} must match the trailing token axes of router_logits "
                f"{logits.shape} (all but the expert axis)."
            )
        where = jnp.broadcast_to(where, lead)
    z = jax.nn.logsumexp(logits.astype(v.compute_dtype(logits.dtype)), axis=-1)
    return jnp.where(where, z * z, 0.0)
