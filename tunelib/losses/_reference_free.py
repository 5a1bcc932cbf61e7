"""Preference losses without a reference model: SimPO, CPO (with AlphaPO's reward) and ORPO."""

import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _deprecation
from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.losses._dpo import smoothed_logistic
from tunelib.losses._dpo_variants import power_transform

# A probability of exactly 1 has infinite odds; ORPO clamps log-probs to at most this value.
MAX_ORPO_LOGP = -1e-12


@_deprecation.renamed_arguments(gamma="margin")
def simpo_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 2.0,
    margin: Scalar = 1.0,
    label_smoothing: Scalar = 0.0,
    reward_shape: Scalar = 0.0,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Simple preference optimisation (SimPO): a length-normalised, reference-free margin loss.

    $$
    \ell = -(1 - \varepsilon) \log \sigma(x) - \varepsilon \log \sigma(-x),
    \qquad x = \beta \big(R_\alpha(\bar\ell_w) - R_\alpha(\bar\ell_l)\big) - \gamma,
    \qquad R_\alpha(\bar\ell) = \frac{1 - e^{-\alpha \bar\ell}}{\alpha}
    $$

    with the per-token average log-probabilities $\bar\ell_w = \tfrac{1}{|y_w|} \log
    \pi_\theta(y_w)$ = `chosen_logps` and $\bar\ell_l$ = `rejected_logps` (compute them with
    `sequence_mean`), $\beta$ = `beta`, the target reward margin $\gamma$ = `margin`,
    $\varepsilon$ = `label_smoothing` and $\alpha$ = `reward_shape`. With $\alpha = 0$ (the
    default) $R_0(\bar\ell) = \bar\ell$: SimPO, whose loss depends on the two inputs only
    through their difference. With $\alpha \ne 0$ it is AlphaPO: the reward
    $R_\alpha(\bar\ell) = (1 - \pi_\theta(y)^{-\alpha/|y|})/\alpha$ bends the log-likelihood
    reward; its slope $e^{-\alpha \bar\ell}$ weighs each completion's gradient by a power of its
    probability, which the paper uses to control how far the chosen likelihood falls
    (likelihood displacement) and over-optimisation. The exponent $-\alpha \bar\ell$ is capped
    at 80 (see `f_dpo_scores`), so the loss stays finite; TRL does not cap it.

    The paper has $\varepsilon = 0$; TRL's `CPOTrainer` applies $\varepsilon$ as in cDPO.
    TRL 1.16: `CPOTrainer` with `loss_type="simpo"`, `simpo_gamma` = $\gamma$ and `alpha` =
    $\alpha$ (AlphaPO); it also adds `cpo_alpha` (default 1) times a token-mean NLL of the
    chosen completions (see `cpo_loss`), so set `cpo_alpha=0` there for SimPO itself.
    `margin` was called `gamma`, the paper's symbol, which tunelib keeps for the discount of
    returns; the old name still works until tunelib 0.3.0, with a `DeprecationWarning`.

    Args:
      chosen_logps: `[B]` per-token average policy log-probabilities of the chosen
        completions.
      rejected_logps: `[B]` per-token average log-probabilities of the rejected completions.
      beta: $\beta > 0$. The paper's released models use 2.0 or 2.5 and its authors report
        that 10 is often better; the default is 2.0. May be traced.
      margin: the target margin $\gamma$ in reward units. The authors recommend tuning
        $\gamma/\beta$ from 0.5 within $[0, 1]$; the default 1.0 is $\gamma/\beta = 0.5$ at
        the default $\beta$. (TRL's `simpo_gamma` is the same $\gamma$, default 0.5 with
        $\beta = 0.1$.) May be traced.
      label_smoothing: $\varepsilon \in [0, 1]$; may be traced.
      reward_shape: AlphaPO's $\alpha$, a finite number; 0 (the default) is SimPO. The paper
        tunes it together with $\beta$ and $\gamma$. May be traced.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import simpo_loss
      >>> chosen, rejected = jnp.array([-0.8, -1.5]), jnp.array([-1.6, -1.2])
      >>> print(simpo_loss(chosen, rejected).round(4).tolist())
      [0.4375, 1.7839]
      >>> print(simpo_loss(chosen, rejected, reward_shape=0.25).round(4).tolist())  # AlphaPO
      [0.2719, 1.9883]

    References:
      Meng et al., "SimPO: Simple Preference Optimization with a Reference-Free Reward",
      2024, https://arxiv.org/abs/2405.14734.
      Gupta et al., "AlphaPO: Reward Shape Matters for LLM Alignment", 2025,
      https://arxiv.org/abs/2501.03884.
    """
    v.positive_scalar(beta, "beta")
    v.unit_interval(label_smoothing, "label_smoothing")
    v.finite_number(reward_shape, "reward_shape")
    (chosen, rejected), where = v.masked_floats(
        where, ndim=1, chosen_logps=chosen_logps, rejected_logps=rejected_logps
    )
    dtype = chosen.dtype
    shaped = power_transform(chosen, reward_shape) - power_transform(rejected, reward_shape)
    logits = jnp.asarray(beta, dtype) * shaped - jnp.asarray(margin, dtype)
    return jnp.where(where, smoothed_logistic(logits, label_smoothing), 0.0)


def _with_nll(
    chosen_logps: ArrayLike,
    rejected_logps: ArrayLike,
    chosen_nll: ArrayLike | None,
    where: ArrayLike | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Checked chosen and rejected log-probs, the NLL term (default `-chosen_logps`), mask."""
    named = {"chosen_logps": chosen_logps, "rejected_logps": rejected_logps}
    if chosen_nll is not None:
        named["chosen_nll"] = chosen_nll
    arrays, where = v.masked_floats(where, ndim=1, **named)
    chosen, rejected = arrays[:2]
    nll = arrays[2] if chosen_nll is not None else -chosen
    return chosen, rejected, nll, where


@_deprecation.renamed_arguments(alpha="nll_weight")
def cpo_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    label_smoothing: Scalar = 0.0,
    nll_weight: Scalar = 1.0,
    reward_shape: Scalar = 0.0,
    chosen_nll: Float[ArrayLike, " B"] | None = None,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Contrastive preference optimisation (CPO): reference-free DPO plus an NLL term.

    $$
    \ell = -(1 - \varepsilon) \log \sigma(x) - \varepsilon \log \sigma(-x)
           + \lambda\, \mathrm{NLL}(y_w),
    \qquad x = \beta \big(R_\alpha(\log \pi_\theta(y_w)) - R_\alpha(\log \pi_\theta(y_l))\big)
    $$

    with $\log \pi_\theta(y_w)$ = `chosen_logps`, $\log \pi_\theta(y_l)$ = `rejected_logps`
    (sums over tokens), $\beta$ = `beta`, $\varepsilon$ = `label_smoothing`, $\lambda$ =
    `nll_weight`, $\mathrm{NLL}(y_w)$ = `chosen_nll`, by default $-\log \pi_\theta(y_w)$ as in
    the paper, and AlphaPO's reward $R_\alpha(\ell) = (1 - e^{-\alpha \ell})/\alpha$ with
    $\alpha$ = `reward_shape` (see `simpo_loss`); $R_0(\ell) = \ell$, the default, is CPO.

    TRL's `CPOTrainer` (1.16, `loss_type="sigmoid"`, `cpo_alpha` = $\lambda$, `alpha` =
    $\alpha$) does not add an NLL per pair: its NLL is one token mean over the whole batch,
    the chosen completions' summed token NLL divided by their total number of tokens, added
    once to the mean of the per-pair preference terms. Its loss is therefore

    ```python
    preference = cpo_loss(chosen_logps, rejected_logps, beta=beta, nll_weight=0.0)
    nll = aggregate(-chosen_token_logps, mode="token_mean", where=chosen_mask)
    loss = jnp.mean(preference) + cpo_alpha * nll.mean()
    ```

    with `chosen_token_logps` the chosen completions' `[B, T]` token log-probs and
    `chosen_mask` their completion mask. No `chosen_nll` per pair reproduces it for a batch of
    unequal lengths: the token mean weighs long completions more than a mean of per-pair
    NLLs. `nll_weight` was called `alpha`, which still works until tunelib 0.3.0, with a
    `DeprecationWarning` (AlphaPO's $\alpha$ is therefore `reward_shape`).

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions.
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      beta: $\beta > 0$; the default 0.1 is the paper's and TRL's. May be traced.
      label_smoothing: $\varepsilon \in [0, 1]$ (0 in the paper); may be traced.
      nll_weight: $\lambda$, the weight of the NLL term; the default 1 is the paper's and TRL's.
        May be traced.
      reward_shape: AlphaPO's $\alpha$, a finite number; 0 (the default) is CPO. The exponent
        $-\alpha \log \pi_\theta(y)$ is capped at 80. May be traced.
      chosen_nll: optional `[B]` NLL of the chosen completions; `-chosen_logps` when None.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import cpo_loss
      >>> print(cpo_loss(jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])).round(4).tolist())
      [10.513, 12.7444]

    References:
      Xu et al., "Contrastive Preference Optimization: Pushing the Boundaries of LLM
      Performance in Machine Translation", 2024, https://arxiv.org/abs/2401.08417.
      Gupta et al., "AlphaPO: Reward Shape Matters for LLM Alignment", 2025,
      https://arxiv.org/abs/2501.03884.
    """
    v.positive_scalar(beta, "beta")
    v.unit_interval(label_smoothing, "label_smoothing")
    v.finite_number(reward_shape, "reward_shape")
    chosen, rejected, nll, where = _with_nll(chosen_logps, rejected_logps, chosen_nll, where)
    dtype = chosen.dtype
    shaped = power_transform(chosen, reward_shape) - power_transform(rejected, reward_shape)
    preference = smoothed_logistic(jnp.asarray(beta, dtype) * shaped, label_smoothing)
    return jnp.where(where, preference + jnp.asarray(nll_weight, dtype) * nll, 0.0)


def _log1mexp(x: jax.Array) -> jax.Array:
    """`log(1 - exp(x))` for `x < 0`, accurate near 0 and for very negative `x`."""
    near_zero = x > -math.log(2.0)
    # Each branch sees only inputs where it is accurate and finite, so the other's gradient is 0.
    small = jnp.log(-jnp.expm1(jnp.where(near_zero, x, -1.0)))
    large = jnp.log1p(-jnp.exp(jnp.where(near_zero, -1.0, x)))
    return jnp.where(near_zero, small, large)


def _log_odds(logps: jax.Array) -> jax.Array:
    logps = jnp.minimum(logps, MAX_ORPO_LOGP)
    return logps - _log1mexp(logps)


def orpo_log_odds_ratio(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    *,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""ORPO's log odds ratio of the chosen over the rejected completion.

    $$
    \log \frac{\mathrm{odds}(y_w)}{\mathrm{odds}(y_l)},
    \qquad \log \mathrm{odds}(y) = \log P(y) - \log\big(1 - P(y)\big)
    $$

    with $\log P(y_w)$ = `chosen_logps` and $\log P(y_l)$ = `rejected_logps`, per-token
    average log-probabilities (`sequence_mean`), so $P$ is the geometric mean of the token
    probabilities. $\log(1 - e^{x})$ is computed as `log(-expm1(x))` for $x > -\log 2$ and
    `log1p(-exp(x))` otherwise, accurate across the whole range. Inputs are clamped to at
    most $-10^{-12}$ first (an input of 0, a probability of 1, has infinite odds), which keeps
    the value finite and gives such inputs a zero gradient.

    Args:
      chosen_logps: `[B]` per-token average log-probabilities of the chosen completions.
      rejected_logps: `[B]` per-token average log-probabilities of the rejected ones.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` log odds ratios, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import orpo_log_odds_ratio
      >>> chosen, rejected = jnp.array([-0.5, -2.0]), jnp.array([-1.0, -1.0])
      >>> print(orpo_log_odds_ratio(chosen, rejected).round(4).tolist())
      [0.9741, -1.3133]

    References:
      Hong et al., "ORPO: Monolithic Preference Optimization without Reference Model", 2024,
      https://arxiv.org/abs/2403.07691.
    """
    (chosen, rejected), where = v.masked_floats(
        where, ndim=1, chosen_logps=chosen_logps, rejected_logps=rejected_logps
    )
    return jnp.where(where, _log_odds(chosen) - _log_odds(rejected), 0.0)


@_deprecation.renamed_arguments(lambda_="odds_ratio_weight")
def orpo_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    *,
    odds_ratio_weight: Scalar = 0.1,
    label_smoothing: Scalar = 0.0,
    chosen_nll: Float[ArrayLike, " B"] | None = None,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Odds ratio preference optimisation (ORPO): NLL plus a log-odds-ratio penalty.

    $$
    \ell = \mathrm{NLL}(y_w)
         + \lambda \big(-(1 - \varepsilon) \log \sigma(o) - \varepsilon \log \sigma(-o)\big),
    \qquad o = \log \frac{\mathrm{odds}(y_w)}{\mathrm{odds}(y_l)},
    \qquad \mathrm{odds}(y) = \frac{P(y)}{1 - P(y)}
    $$

    with $\log P(y_w)$ = `chosen_logps` and $\log P(y_l)$ = `rejected_logps`, per-token
    average log-probabilities (`sequence_mean`), $\lambda$ = `odds_ratio_weight`,
    $\varepsilon$ = `label_smoothing` and $\mathrm{NLL}(y_w)$ = `chosen_nll`, by default
    `-chosen_logps` (the per-token average NLL, the paper's $\mathcal{L}_{SFT}$). The odds
    ratio $o$ is `orpo_log_odds_ratio`, with its clamp: an input of exactly 0 gives a finite
    loss and gradient. With $\varepsilon = 0$ (the default) this is the paper's ORPO, and
    TRL's `ORPOTrainer`, where `beta` is $\lambda$. With $\varepsilon > 0$ the odds-ratio
    term is the cross-entropy against labels flipped with probability $\varepsilon$, as cDPO
    smooths DPO, and is minimal at the finite $o = \log((1 - \varepsilon)/\varepsilon)$: this
    is Tunix's ORPO with `label_smoothing` (`DPOTrainingConfig(algorithm="orpo")`,
    `tunix/sft/dpo/dpo_trainer.py`, 0.1.7), which TRL's ORPO does not have. Tunix 0.1.7 takes
    the odds of the summed completion log-probs and the NLL as the sum divided by the length;
    later Tunix averages both by default (`average_log_prob_orpo`) and takes the NLL over
    prompt and completion (`enable_prompt_loss_orpo`), which is `chosen_nll`, and clamps the
    log-probs at $-10^{-7}$ (tunelib at $-10^{-12}$). `odds_ratio_weight` was called
    `lambda_`, which still works until tunelib 0.3.0, with a `DeprecationWarning`.

    Args:
      chosen_logps: `[B]` per-token average log-probabilities of the chosen completions.
      rejected_logps: `[B]` per-token average log-probabilities of the rejected ones.
      odds_ratio_weight: $\lambda$, the weight of the odds-ratio term; the default 0.1 is the
        paper's, TRL's and Tunix's. May be traced.
      label_smoothing: $\varepsilon \in [0, 1]$, the assumed label-flip rate; 0 (the default)
        is the paper's ORPO. May be traced.
      chosen_nll: optional `[B]` NLL of the chosen completions; `-chosen_logps` when None.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import orpo_loss
      >>> chosen, rejected = jnp.array([-0.5, -2.0]), jnp.array([-1.0, -1.0])
      >>> print(orpo_loss(chosen, rejected).round(4).tolist())
      [0.532, 2.1551]
      >>> print(orpo_loss(chosen, rejected, label_smoothing=0.1).round(4).tolist())
      [0.5418, 2.142]

    References:
      Hong et al., "ORPO: Monolithic Preference Optimization without Reference Model", 2024,
      https://arxiv.org/abs/2403.07691.
    """
    v.unit_interval(label_smoothing, "label_smoothing")
    chosen, rejected, nll, where = _with_nll(chosen_logps, rejected_logps, chosen_nll, where)
    log_odds_ratio = _log_odds(chosen) - _log_odds(rejected)
    weight = jnp.asarray(odds_ratio_weight, chosen.dtype)
    loss = nll + weight * smoothed_logistic(log_odds_ratio, label_smoothing)
    return jnp.where(where, loss, 0.0)
