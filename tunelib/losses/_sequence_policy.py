r"""Sequence-level policy losses: VESPO's reshaped sequence weight and LUSPO's length-unbiased GSPO.

Both weigh a whole completion by one importance quantity of the sequence. VESPO reshapes the
product of the token ratios, $w_i = \prod_t \pi_\theta(y_{i,t}) / \pi_{\mathrm{old}}(y_{i,t})$,
with a smooth kernel and uses it as a stop-gradient weight of a REINFORCE loss; LUSPO keeps
GSPO's clipped surrogate of the length-normalised ratio and changes only how its per-sequence
terms are summed. Both return per-token `[B, T]` values for `tunelib.losses.aggregate`.
"""

import math

import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.losses._policy_gradient import RATIO_LEVELS, RatioLevel, policy_gradient_loss

# The sequence log-weight and each token's log importance weight are kept above log(1e-8),
# the floor of the VESPO authors' code and of TRL (1.16).
_LOG_WEIGHT_FLOOR = math.log(1e-8)


def vespo_loss(
    token_logps: Float[ArrayLike, "B T"],
    old_token_logps: Float[ArrayLike, "B T"],
    advantages: Float[ArrayLike, " B"] | Float[ArrayLike, "B T"],
    *,
    k_pos: Scalar = 2.0,
    lambda_pos: Scalar = 3.0,
    k_neg: Scalar = 3.0,
    lambda_neg: Scalar = 2.0,
    importance_weights: Float[ArrayLike, "B T"] | None = None,
    log_ratio_clamp: Scalar = 20.0,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""VESPO: a REINFORCE loss weighted by a Gamma-shaped kernel of the sequence ratio.

    $$
    \ell_{i,t} = -\,\mathrm{sg}\big[\phi_{i,t}(w_i)\big]\, A_{i,t}\,
    \log \pi_\theta(y_{i,t}), \qquad
    \phi(w) = w^{k}\, e^{\lambda (1 - w)}, \qquad
    w_i = \prod_{t} \frac{\pi_\theta(y_{i,t})}{\pi_{\mathrm{old}}(y_{i,t})}\, \rho_{i,t}
    $$

    with $\log \pi_\theta$ = `token_logps`, $\log \pi_{\mathrm{old}}$ = `old_token_logps`,
    $A_{i,t}$ = `advantages`, $\rho_{i,t}$ = `importance_weights` (1 when None), the product
    over the valid tokens of row $i$, and $(k, \lambda)$ = (`k_pos`, `lambda_pos`) where
    $A_{i,t} \ge 0$ and (`k_neg`, `lambda_neg`) where $A_{i,t} < 0$. The gradient is
    $-\phi(w_i) A_{i,t} \nabla \log \pi_\theta(y_{i,t})$. The kernel is normalised so that
    $\phi(1) = 1$ (on-policy VESPO is the plain policy gradient); it rises like $w^k$ from
    0, peaks at $w = k / \lambda$ and decays like $e^{-\lambda w}$, so sequences the current
    policy finds far less or far more likely than the behaviour policy lose their weight
    smoothly, without a clip. Unlike GSPO, $w_i$ is the product of the token ratios, not
    their geometric mean: VESPO does not normalise by the length.

    Numerics, as in the VESPO authors' code and TRL (1.16): each token's log-ratio is clipped to
    $[-c, c]$, $c$ = `log_ratio_clamp`, and each $\log \rho_{i,t}$ to
    $[\log 10^{-8}, c]$ (so a weight of 0 counts as $10^{-8}$); their sum over the row,
    $\log w_i$, is clipped to $[\log 10^{-8}, c]$; $\phi$ is computed in log space,
    $\exp(\lambda + k \log w - \lambda w)$. TRL also raises $\lambda$ to at least $10^{-4}$;
    here $\lambda > 0$ is required.

    `importance_weights` corrects for a sampler that differs from the trainer's behaviour
    policy: pass the stop-gradient per-token weights
    $\pi_{\mathrm{old}} / \pi_{\mathrm{sampler}}$ (from `truncated_importance_weights` with
    ``level="token"``), and $w_i$ becomes the ratio of $\pi_\theta$ to the sampler. TRL
    (``loss_type="vespo"``) folds its vLLM importance-sampling ratio in this way and accepts
    only its ``token_truncate`` and ``token_mask`` modes for VESPO.

    Defaults: $k_+ = 2$, $\lambda_+ = 3$, $k_- = 3$, $\lambda_- = 2$, those of the VESPO
    code and TRL (``vespo_k_pos``, ``vespo_lambda_pos``, ``vespo_k_neg``,
    ``vespo_lambda_neg``). TRL reduces VESPO, like CISPO and DAPO, with the token mean over
    the accumulated batch: ``aggregate(mode="global_token_mean")`` with TRL's token count
    (``"token_mean"`` within one batch). VESPO computes its sequence weight itself: TRL expects
    ``importance_sampling_level="token"`` with it, and there is no `level` here.

    Args:
      token_logps: `[B, T]` current-policy log-probs of the sampled tokens (differentiated).
      old_token_logps: `[B, T]` behaviour-policy log-probs.
      advantages: `[B]` (one per sequence) or `[B, T]` (one per token).
      k_pos: $k_+ \ge 0$, the power for non-negative advantages; may be traced.
      lambda_pos: $\lambda_+ > 0$, the decay for non-negative advantages; may be traced.
      k_neg: $k_- \ge 0$, the power for negative advantages; may be traced.
      lambda_neg: $\lambda_- > 0$, the decay for negative advantages; may be traced.
      importance_weights: optional `[B, T]` non-negative per-token weights $\rho$ of the
        behaviour policy over the sampler; they carry no gradient.
      log_ratio_clamp: $c > 0$; may be traced.
      where: `[B, T]` mask, True (or 1) = counts. Masked tokens give 0 and a zero gradient
        and are left out of the product, even when their inputs are NaN or infinite.

    Returns:
      `[B, T]` per-token losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import vespo_loss
      >>> logps = jnp.log(jnp.array([[0.5, 0.6], [0.5, 0.6]]))
      >>> old = jnp.log(jnp.array([[0.5, 0.6], [0.25, 0.6]]))  # w = 1 and w = 2
      >>> adv = jnp.array([1.0, 1.0])
      >>> grad = jax.grad(lambda x: vespo_loss(x, old, adv).sum())(logps)
      >>> print(grad.round(4))  # phi(1) = 1; phi(2) = 4 e^-3 = 0.1991
      [[-1.     -1.    ]
       [-0.1991 -0.1991]]

    References:
      Shen et al., "VESPO: Variational Sequence-Level Soft Policy Optimization for Stable
      Off-Policy LLM Training", 2026, https://arxiv.org/abs/2602.10693.
    """
    for name, value in (("k_pos", k_pos), ("k_neg", k_neg)):
        v.non_negative(value, name)
    for name, value in (("lambda_pos", lambda_pos), ("lambda_neg", lambda_neg)):
        v.positive_scalar(value, name)
    v.positive_scalar(log_ratio_clamp, "log_ratio_clamp")
    arrays = {"token_logps": token_logps, "old_token_logps": old_token_logps}
    if importance_weights is not None:
        arrays["importance_weights"] = importance_weights
    checked, where = v.masked_floats(where, ndim=2, **arrays)
    adv = v.advantages_array(advantages, where, checked[0].dtype)
    dtype = adv.dtype
    logps, old = checked[0].astype(dtype), lax.stop_gradient(checked[1].astype(dtype))
    clamp = jnp.asarray(log_ratio_clamp, dtype)
    log_ratio = jnp.clip(lax.stop_gradient(logps) - old, -clamp, clamp)
    if importance_weights is not None:
        rho = lax.stop_gradient(checked[2].astype(dtype))
        log_rho = jnp.clip(jnp.log(jnp.maximum(rho, 1e-8)), _LOG_WEIGHT_FLOOR, clamp)
        log_ratio = log_ratio + jnp.where(where, log_rho, 0.0)
    log_w = jnp.clip(jnp.sum(log_ratio, axis=-1, keepdims=True), _LOG_WEIGHT_FLOOR, clamp)
    non_negative = adv >= 0
    k = jnp.where(non_negative, jnp.asarray(k_pos, dtype), jnp.asarray(k_neg, dtype))
    lam = jnp.where(non_negative, jnp.asarray(lambda_pos, dtype), jnp.asarray(lambda_neg, dtype))
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jnp.where(where, -phi * adv * logps, 0.0)


def luspo_loss(
    token_logps: Float[ArrayLike, "B T"],
    old_token_logps: Float[ArrayLike, "B T"] | None,
    advantages: Float[ArrayLike, " B"] | Float[ArrayLike, "B T"],
    *,
    level: RatioLevel = "sequence",
    epsilon_low: Scalar = 3e-4,
    epsilon_high: Scalar = 4e-4,
    ratio_cap: Scalar | None = None,
    log_ratio_clamp: Scalar = 20.0,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""LUSPO: GSPO's clipped sequence surrogate, to be summed over tokens per sequence.

    $$
    \mathcal{L} = \frac{1}{G} \sum_{i=1}^{G} |y_i|\, \ell_i, \qquad
    \ell_i = -\min\big(s_i A_i,\; \mathrm{clip}(s_i, 1 - \varepsilon_{\mathrm{low}},
             1 + \varepsilon_{\mathrm{high}})\, A_i\big)
    $$

    with $s_i$ GSPO's length-normalised sequence ratio of `token_logps` over
    `old_token_logps` (see `importance_ratio`), $A_i$ = `advantages`, $|y_i|$ the number of
    valid tokens of row $i$ (from `where`), $\varepsilon_{\mathrm{low}}$ = `epsilon_low` and
    $\varepsilon_{\mathrm{high}}$ = `epsilon_high`. GSPO averages $\ell_i$ over sequences,
    which gives a long completion as much weight as a short one in total and so, per token,
    less: the paper shows that this biases GSPO towards short answers and can collapse the
    response length. LUSPO multiplies each sequence's term by its length.

    This function returns $\ell_i$ on every valid token of row $i$, exactly
    `policy_gradient_loss` at the same `level`; the length weight is the reduction. Summing a
    row's tokens gives $|y_i| \ell_i$, so LUSPO's loss is the mean over sequences of each
    sequence's token sum: ``aggregate(values, mode="seq_mean_token_sum",
    where=where).mean()``. TRL (1.16, ``loss_type="luspo"``) reduces the same way but counts
    rows without a valid token as sequences of loss 0: ``empty_rows="count"`` gives exactly
    its value.

    `level`: ``"sequence"`` (default, LUSPO's and GSPO's ratio; TRL warns unless
    ``importance_sampling_level="sequence"``), ``"sequence_token"`` (GSPO-token) or
    ``"token"`` (TRL's ``importance_sampling_level="token"``, with the same reduction).

    Defaults: GSPO's clip range, $\varepsilon_{\mathrm{low}} = 3 \times 10^{-4}$,
    $\varepsilon_{\mathrm{high}} = 4 \times 10^{-4}$, which LUSPO builds on. TRL uses its
    global ``epsilon`` and ``epsilon_high`` (0.2 unless set) for ``"luspo"``; pass those
    values here to match it. `ratio_cap` is TRL's ``delta`` (two-sided clipping) as in
    `policy_gradient_loss`.

    Args:
      token_logps: `[B, T]` current-policy log-probs of the sampled tokens (differentiated).
      old_token_logps: `[B, T]` behaviour-policy log-probs, or None for on-policy data.
      advantages: `[B]` (one per sequence) or `[B, T]` (one per token).
      level: ``"sequence"``, ``"sequence_token"`` or ``"token"`` (static).
      epsilon_low: $\varepsilon_{\mathrm{low}} \ge 0$; may be traced.
      epsilon_high: $\varepsilon_{\mathrm{high}} \ge 0$; may be traced.
      ratio_cap: $C > 0$, an upper bound of the ratio in both terms, or None; may be traced.
      log_ratio_clamp: bound on the log-ratio before `exp` (see `importance_ratio`); may be
        traced.
      where: `[B, T]` mask, True (or 1) = counts. Masked tokens give 0 and a zero gradient,
        and are left out of the sequence ratio and the lengths.

    Returns:
      `[B, T]` per-token losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import aggregate, luspo_loss
      >>> logps = jnp.log(jnp.array([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
      >>> where = jnp.array([[True, True, True], [True, False, False]])
      >>> per_token = luspo_loss(logps, logps, jnp.array([1.0, -1.0]), where=where)
      >>> print(per_token)
      [[-1. -1. -1.]
       [ 1.  0.  0.]]
      >>> luspo = aggregate(per_token, mode="seq_mean_token_sum", where=where)
      >>> print(luspo.mean())  # (3 * -1 + 1 * 1) / 2
      -1.0

    References:
      Liu et al., "Length-Unbiased Sequence Policy Optimization: Revealing and Controlling
      Response Length Variation in RLVR", 2026, https://arxiv.org/abs/2602.05261.
      Zheng et al., "Group Sequence Policy Optimization", 2025,
      https://arxiv.org/abs/2507.18071.
    """
    v.one_of(level, "level", RATIO_LEVELS)
    return policy_gradient_loss(
        token_logps,
        old_token_logps,
        advantages,
        level=level,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        ratio_cap=ratio_cap,
        log_ratio_clamp=log_ratio_clamp,
        where=where,
    )
