r"""Per-token penalties towards a reference policy: Schulman's sample estimators of the KL.

Every estimator here is a function of the log-ratio of a sampled token $y_t$,

$$
\log r_t = \log \pi_{\mathrm{ref}}(y_t) - \log \pi_\theta(y_t),
$$

and estimates the reverse divergence $\mathrm{KL}(\pi_\theta \,\|\, \pi_{\mathrm{ref}})$ when
$y_t \sim \pi_\theta$. With the sampling distribution held fixed when differentiating (what a
loss on sampled tokens does), the expected gradients on-policy are

* ``"k1"``: $\mathbb{E}[\nabla k_1] = \mathbb{E}[\nabla \log \pi_\theta] = 0$. The k1 *loss*
  has no expected gradient at all, only noise; k1 belongs in the reward
  (`tunelib.advantages.kl_reward_shaping`), where the policy gradient differentiates it
  correctly.
* ``"k2"``: $\mathbb{E}[\nabla k_2] = \mathbb{E}[\log(\pi_\theta/\pi_{\mathrm{ref}})\,
  \nabla \log \pi_\theta] = \nabla \mathrm{KL}(\pi_\theta \,\|\, \pi_{\mathrm{ref}})$, the exact
  gradient, although $\mathbb{E}[k_2]$ is the KL only to second order.
* ``"k3"``: $\mathbb{E}[\nabla k_3] = \mathbb{E}[(1 - r)\nabla \log \pi_\theta]
  = \nabla \mathrm{KL}(\pi_{\mathrm{ref}} \,\|\, \pi_\theta)$, the gradient of the *forward*
  KL, which agrees with the reverse one only to first order in $\pi_\theta - \pi_{\mathrm{ref}}$.

The importance-weighted form of `kl_penalty` (``old_token_logps``) makes the k1 and k3 losses
exact: their expected gradient is then $\nabla \mathrm{KL}(\pi_\theta \,\|\, \pi_{\mathrm{ref}})$
on- and off-policy.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._numerics import exp_minus_one_minus
from tunelib._typing import Mask, Scalar
from tunelib.losses._policy_gradient import RATIO_LEVELS, RatioLevel, ratio_from_logps

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = KLEstimator.__args__


def _estimate(log_ratio: jax.Array, estimator: str) -> jax.Array:
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return exp_minus_one_minus(log_ratio)


def kl_penalty(
    token_logps: Float[ArrayLike, "B T"],
    ref_token_logps: Float[ArrayLike, "B T"],
    *,
    estimator: KLEstimator = "k3",
    log_ratio_clamp: Scalar = 20.0,
    estimate_clamp: Scalar | None = None,
    old_token_logps: Float[ArrayLike, "B T"] | None = None,
    level: RatioLevel = "token",
    stop_gradient_weight: bool = False,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Per-token estimate of $\mathrm{KL}(\pi_\theta \,\|\, \pi_{\mathrm{ref}})$, to add to a loss.

    $$
    k_1 = -\log r_t, \qquad k_2 = \tfrac12 (\log r_t)^2, \qquad k_3 = (r_t - 1) - \log r_t,
    \qquad \log r_t = \operatorname{clip}\big(\log \pi_{\mathrm{ref}}(y_t) - \log \pi_\theta(y_t),
    -c, c\big),
    $$

    and, when `old_token_logps` is given, the importance-weighted estimate
    $w_t\, \operatorname{clip}(k_t, -C, C)$ with
    $w_t = \exp\operatorname{clip}(\log \pi_\theta(y_t) - \log \pi_{\mathrm{old}}(y_t), -c, c)$
    (at ``level="token"``; see below for ``"sequence"``),
    where $\log \pi_\theta$ = `token_logps`, $\log \pi_{\mathrm{ref}}$ = `ref_token_logps`,
    $\log \pi_{\mathrm{old}}$ = `old_token_logps`, $c$ = `log_ratio_clamp` and $C$ =
    `estimate_clamp` (no clip when None). Schulman (2020) shows that $k_1$ and $k_3$ are
    unbiased for the KL when $y_t \sim \pi_\theta$, that $k_2, k_3 \ge 0$ with equality only at
    $\log r_t = 0$, and that $k_3$ has a much lower variance than $k_1$ when the policies are
    close; $k_2$ is biased, its mean matches the KL to second order.

    Which estimator, and what the anchors use:

    * GRPO (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300, eq. 4) adds $\beta k_3$ to the
      loss, with $\beta = 0.04$ in that paper; TRL's `GRPOTrainer` and Tunix
      (``"low_var_kl"``, its default) use k3 as well. Default here: ``"k3"``.
    * verl names them ``"kl"``/``"k1"``, ``"mse"``/``"k2"`` and ``"low_var_kl"``/``"k3"``; its
      ``low_var_kl`` clips the log-ratio to $[-20, 20]$ and the k3 *value* to $[-10, 10]$,
      i.e. ``estimator="k3", log_ratio_clamp=20, estimate_clamp=10`` here. Tunix offers an
      optional symmetric clip of the value (its ``clamp_value``, our `estimate_clamp`); TRL
      clips neither.
    * The gradients differ (see the module docstring): on-policy the k1 loss has zero expected
      gradient, k2 has the exact gradient of the reverse KL, k3 the gradient of the forward KL
      $\mathrm{KL}(\pi_{\mathrm{ref}} \,\|\, \pi_\theta)$.

    Importance weighting (DeepSeek-V3.2, arXiv 2512.02556, sec. 3.1, "unbiased KL estimate"):
    the tokens are sampled from $\pi_{\mathrm{old}}$, not $\pi_\theta$, so each estimate is
    multiplied by $w_t = \pi_\theta(y_t) / \pi_{\mathrm{old}}(y_t)$, which makes
    $\mathbb{E}_{\pi_{\mathrm{old}}}[w k] = \mathbb{E}_{\pi_\theta}[k]
    = \mathrm{KL}(\pi_\theta \,\|\, \pi_{\mathrm{ref}})$ for k1 and k3. The paper
    differentiates $w_t$ (as TRL's `use_bias_correction_kl` does), and then the expected
    gradient of $w k_1$ and of $w k_3$ is exactly $\nabla \mathrm{KL}(\pi_\theta \,\|\,
    \pi_{\mathrm{ref}})$; this is the default, ``stop_gradient_weight=False``. It changes the
    gradient even on-policy, where $w_t = 1$ in value: pass
    ``old_token_logps=jax.lax.stop_gradient(token_logps)`` for the exact KL gradient on-policy.
    ``stop_gradient_weight=True`` treats $w_t$ as data: the value is the same, the expected
    gradient is the on-policy one of the estimator (0 for k1, the forward-KL gradient for k3).

    `level` picks the importance weight as in `importance_ratio`: ``"token"`` (default, the
    paper's) is $w_t$ above; ``"sequence"`` is GSPO's length-normalised sequence ratio
    $s_i = \exp \operatorname{clip}\big(\frac{1}{|y_i|} \sum_u (\log \pi_\theta(y_{i,u}) -
    \log \pi_{\mathrm{old}}(y_{i,u})), -c, c\big)$ on every token of row $i$, differentiated
    through every token of the row (unless `stop_gradient_weight`); ``"sequence_token"`` has
    the value $s_i$ with each token's weight differentiated through its own log-prob only.
    TRL's (1.16) ``use_bias_correction_kl=True`` multiplies its k3 by the importance ratio of the
    policy loss, undetached: with ``importance_sampling_level="token"`` that is
    ``estimator="k3", old_token_logps=old`` here, with ``"sequence"`` it is the same with
    ``level="sequence"``. TRL clips neither log-ratio; the default clamp $c = 20$ binds only
    beyond a ratio of $e^{20}$. The sequence-level weight matches the policy term's ratio
    but, being a geometric mean rather than a likelihood ratio, does not make the estimate
    unbiased.

    Args:
      token_logps: `[B, T]` log-probabilities of the sampled tokens under the current policy
        $\pi_\theta$ (differentiated).
      ref_token_logps: `[B, T]` log-probabilities of the same tokens under the reference
        policy.
      estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (default, GRPO's).
      log_ratio_clamp: $c > 0$; both log-ratios are clipped to $[-c, c]$ before use, so
        $\exp$ stays finite (float32 overflows past 88) and gradients stay bounded; a clipped
        token has zero gradient. The default 20 is verl's; it never binds unless one policy
        gives a token $e^{20}$ times the probability of the other. May be traced.
      estimate_clamp: optional $C > 0$; each token's estimate is clipped to $[-C, C]$ (before
        the importance weight). None (default) clips nothing. May be traced.
      old_token_logps: optional `[B, T]` log-probabilities under the behaviour policy that
        sampled the tokens; given, each estimate is multiplied by the importance weight above.
      level: ``"token"`` (default), ``"sequence"`` or ``"sequence_token"``: the level of
        the importance weight (static); other than ``"token"`` only with `old_token_logps`.
      stop_gradient_weight: whether the importance weight is held constant when
        differentiating; only with `old_token_logps`. Default False, the paper's form.
      where: `[B, T]` mask, True (or 1) = a completion token that counts. Masked tokens give
        exactly 0 and a zero gradient, even when their inputs are NaN or infinite.

    Returns:
      `[B, T]` per-token estimates, float32 (float64 for float64 input); reduce them with
      `tunelib.losses.aggregate` and scale by the KL coefficient ($\beta$ above).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import kl_penalty
      >>> logps, ref_logps = jnp.array([[-1.0, -2.0, -0.5]]), jnp.array([[-1.5, -1.0, -0.5]])
      >>> for estimator in ("k1", "k2", "k3"):
      ...     print(estimator, kl_penalty(logps, ref_logps, estimator=estimator).round(4))
      k1 [[ 0.5 -1.   0. ]]
      k2 [[0.125 0.5   0.   ]]
      k3 [[0.1065 0.7183 0.    ]]
      >>> old_logps = jnp.array([[-1.0, -2.5, -0.5]])  # the weight is e^0.5 on token 2
      >>> print(kl_penalty(logps, ref_logps, old_token_logps=old_logps).round(3))
      [[0.107 1.184 0.   ]]
      >>> # The sequence weight is exp(0.5 / 3) on every token.
      >>> print(kl_penalty(logps, ref_logps, old_token_logps=old_logps, level="sequence").round(3))
      [[0.126 0.849 0.   ]]

    References:
      Schulman, "Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html.
      Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
      Language Models", 2024, https://arxiv.org/abs/2402.03300.
      DeepSeek-AI, "DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models", 2025,
      https://arxiv.org/abs/2512.02556.
    """
    v.one_of(estimator, "estimator", KL_ESTIMATORS)
    v.one_of(level, "level", RATIO_LEVELS)
    v.positive_scalar(log_ratio_clamp, "log_ratio_clamp")
    if estimate_clamp is not None:
        v.positive_scalar(estimate_clamp, "estimate_clamp")
    if stop_gradient_weight and old_token_logps is None:
        raise ValueError(
            "stop_gradient_weight applies to the importance weight, which needs "
            "old_token_logps; got old_token_logps=None."
        )
    if level != "token" and old_token_logps is None:
        raise ValueError(
            f"level={level!r} is the level of the importance weight, which needs "
            "old_token_logps; got old_token_logps=None."
        )
    arrays = {"token_logps": token_logps, "ref_token_logps": ref_token_logps}
    if old_token_logps is not None:
        arrays["old_token_logps"] = old_token_logps
    checked, where = v.masked_floats(where, ndim=2, **arrays)
    logps, ref = checked[0], checked[1]
    bound = jnp.asarray(log_ratio_clamp, logps.dtype)
    kl = _estimate(jnp.clip(ref - logps, -bound, bound), estimator)
    if estimate_clamp is not None:
        value_bound = jnp.asarray(estimate_clamp, logps.dtype)
        kl = jnp.clip(kl, -value_bound, value_bound)
    if old_token_logps is not None:
        weight = ratio_from_logps(logps, checked[2], where, level, log_ratio_clamp)
        if stop_gradient_weight:
            weight = jax.lax.stop_gradient(weight)
        kl = weight * kl
    return jnp.where(where, kl, 0.0)
