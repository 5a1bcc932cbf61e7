r"""Policy-gradient surrogates: importance ratios, PPO / GRPO / GSPO clipping, CISPO and SAPO.

Every loss here is a per-token `[B, T]` value whose gradient is a weighted policy gradient
$-w_t A_t \nabla_\theta \log \pi_\theta(y_t)$; the methods differ in the weight $w_t$ they
derive from the importance ratio $r_t = \pi_\theta(y_t) / \pi_{\theta_\mathrm{old}}(y_t)$.
Reduce the values with `tunelib.losses.aggregate`.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar

RatioLevel = Literal["token", "sequence", "sequence_token"]
RATIO_LEVELS: tuple[str, ...] = RatioLevel.__args__


def ratio_from_logps(
    logps: jax.Array, old: jax.Array, where: jax.Array, level: str, log_ratio_clamp: Scalar
) -> jax.Array:
    """The importance ratio of checked, masked inputs at `level` (0 on masked tokens)."""
    clamp = jnp.asarray(log_ratio_clamp, logps.dtype)
    log_ratio = logps - old
    if level == "token":
        ratio = jnp.exp(jnp.clip(log_ratio, -clamp, clamp))
    else:
        count = jnp.maximum(jnp.sum(where, axis=-1, keepdims=True), 1).astype(logps.dtype)
        mean = jnp.clip(jnp.sum(log_ratio, axis=-1, keepdims=True) / count, -clamp, clamp)
        if level == "sequence":
            ratio = jnp.broadcast_to(jnp.exp(mean), logps.shape)
        else:
            ratio = lax.stop_gradient(jnp.exp(mean)) * jnp.exp(logps - lax.stop_gradient(logps))
    return jnp.where(where, ratio, 0.0)


def importance_ratio(
    token_logps: Float[ArrayLike, "B T"],
    old_token_logps: Float[ArrayLike, "B T"] | None,
    *,
    level: RatioLevel = "token",
    log_ratio_clamp: Scalar = 20.0,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Importance ratio of the current over the behaviour policy, per token or per sequence.

    $$
    r_{i,t} = e^{\log \pi_\theta(y_{i,t}) - \log \pi_{\mathrm{old}}(y_{i,t})}, \qquad
    s_i = \exp\Big(\frac{1}{|y_i|} \sum_{t} \big(\log \pi_\theta(y_{i,t})
          - \log \pi_{\mathrm{old}}(y_{i,t})\big)\Big), \qquad
    s_{i,t} = \mathrm{sg}[s_i] \, e^{\log \pi_\theta(y_{i,t})
          - \mathrm{sg}[\log \pi_\theta(y_{i,t})]}
    $$

    with $\log \pi_\theta$ = `token_logps`, $\log \pi_{\mathrm{old}}$ = `old_token_logps`, the
    sums over the valid tokens of row $i$ ($|y_i|$ of them, from `where`) and $\mathrm{sg}$
    the stop-gradient. `level` picks one:

    * ``"token"``: $r_{i,t}$, the per-token ratio of PPO and GRPO.
    * ``"sequence"``: $s_i$, GSPO's length-normalised sequence ratio (the geometric mean of
      the token ratios), the same value on every valid token of the row; its gradient reaches
      every token of the row, $\partial s_i / \partial \log \pi_\theta(y_{i,t}) = s_i / |y_i|$.
    * ``"sequence_token"``: $s_{i,t}$ (GSPO-token): the value $s_i$, but each token's entry
      differentiates only through its own log-prob,
      $\partial s_{i,t} / \partial \log \pi_\theta(y_{i,t}) = s_i$. With one advantage per
      sequence and the per-sequence token mean, GSPO-token's objective and gradient equal
      GSPO's; with per-token advantages it weighs each token's gradient by its own advantage.

    The log-ratio (per token, or the row mean) is clamped to
    $[-c, c]$, $c$ = `log_ratio_clamp`, before `exp`, so the ratio stays finite (the default
    $e^{20} \approx 4.9 \times 10^8$ is far outside any trust region); entries beyond the
    clamp get no gradient through it.

    Args:
      token_logps: `[B, T]` log-probs of the sampled tokens under the current policy
        (differentiated).
      old_token_logps: `[B, T]` log-probs under the behaviour policy that sampled them, or
        None for on-policy data: then $\log \pi_{\mathrm{old}} = \mathrm{sg}[\log \pi_\theta]$,
        so the ratio is 1 in value and its gradient is $\nabla \log \pi_\theta$.
      level: ``"token"``, ``"sequence"`` or ``"sequence_token"`` (static).
      log_ratio_clamp: $c > 0$; may be traced.
      where: `[B, T]` mask, True (or 1) = a completion token that counts. Masked tokens give
        exactly 0 and a zero gradient, even when their log-probs are NaN or infinite, and are
        left out of the sequence means.

    Returns:
      `[B, T]` ratios, float32 (float64 for float64 input), 0 on masked tokens.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import importance_ratio
      >>> logps = jnp.array([[-1.0, -2.0, -3.0]])
      >>> old = jnp.array([[-1.5, -1.5, jnp.nan]])
      >>> where = jnp.array([[True, True, False]])
      >>> print(importance_ratio(logps, old, where=where).round(4))
      [[1.6487 0.6065 0.    ]]
      >>> print(importance_ratio(logps, old, level="sequence", where=where).round(4))
      [[1. 1. 0.]]

    References:
      Schulman et al., "Proximal Policy Optimization Algorithms", 2017,
      https://arxiv.org/abs/1707.06347.
      Zheng et al., "Group Sequence Policy Optimization", 2025,
      https://arxiv.org/abs/2507.18071.
    """
    v.one_of(level, "level", RATIO_LEVELS)
    v.positive_scalar(log_ratio_clamp, "log_ratio_clamp")
    logps, old, where = v.behaviour_logps(token_logps, old_token_logps, where)
    return ratio_from_logps(logps, old, where, level, log_ratio_clamp)


def policy_gradient_loss(
    token_logps: Float[ArrayLike, "B T"],
    old_token_logps: Float[ArrayLike, "B T"] | None,
    advantages: Float[ArrayLike, " B"] | Float[ArrayLike, "B T"],
    *,
    level: RatioLevel = "token",
    epsilon_low: Scalar = 0.2,
    epsilon_high: Scalar = 0.2,
    dual_clip: Scalar | None = None,
    ratio_cap: Scalar | None = None,
    log_ratio_clamp: Scalar = 20.0,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Clipped surrogate policy loss of PPO / GRPO / DAPO / GSPO, with dual clip and ratio cap.

    $$
    \ell_t = -\min\big(\tilde r_t A_t,\; \min(\mathrm{clip}(r_t, 1 - \varepsilon_{\mathrm{low}},
             1 + \varepsilon_{\mathrm{high}}), C)\, A_t\big), \qquad
    \tilde r_t = \min(r_t, C), \qquad
    \ell_t \leftarrow \min(\ell_t, -c A_t) \text{ if } A_t < 0
    $$

    with $r_t$ the importance ratio of `token_logps` over `old_token_logps` at `level` (see
    `importance_ratio`), $A_t$ = `advantages`, $\varepsilon_{\mathrm{low}}$ =
    `epsilon_low`, $\varepsilon_{\mathrm{high}}$ = `epsilon_high`, $C$ = `ratio_cap`
    ($+\infty$ when None) and $c$ = `dual_clip` (no bound when None).

    The gradient with respect to `token_logps` is $-A_t \nabla r_t$ inside the trust region
    and on the side the advantage does not push past (a token with $A_t > 0$ and
    $r_t < 1 - \varepsilon_{\mathrm{low}}$ keeps its full gradient), and exactly 0 once the
    ratio has left the region in the direction its advantage pushes ($A_t > 0$,
    $r_t > 1 + \varepsilon_{\mathrm{high}}$, or $A_t < 0$, $r_t < 1 - \varepsilon_{\mathrm{low}}$).
    Ties go to the unclipped term, so a ratio exactly on a bound keeps its gradient.

    Where the sources differ:

    * Clip range: PPO (Schulman et al. 2017) and GRPO (Shao et al. 2024) clip symmetrically
      with $\varepsilon = 0.2$ (our defaults); DAPO's clip-higher (Yu et al. 2025) uses
      $\varepsilon_{\mathrm{low}} = 0.2$, $\varepsilon_{\mathrm{high}} = 0.28$. GSPO (Zheng
      et al. 2025) clips the sequence ratio, ``level="sequence"``, with far smaller ranges,
      $\varepsilon_{\mathrm{low}} = 3 \times 10^{-4}$, $\varepsilon_{\mathrm{high}} =
      4 \times 10^{-4}$, and averages per sequence (reduce with
      ``aggregate(mode="seq_mean_token_mean")``); ``"sequence_token"`` is GSPO-token.
    * `dual_clip` (Ye et al. 2020, $c = 3$ in the paper): for $A_t < 0$ the loss is also
      bounded by $-c A_t$, so a token whose ratio has grown past $c$ no longer contributes an
      unbounded term or any gradient. Off by default, as in PPO and GRPO.
    * `ratio_cap`: an upper bound $C$ on the ratio in both terms. INTELLECT-2's two-sided
      GRPO clipping (Prime Intellect 2025; TRL's `delta`) caps the ratio of tokens with
      negative advantages at $\delta > 1 + \varepsilon$; with
      $C \ge 1 + \varepsilon_{\mathrm{high}}$ the cap binds only for $A_t < 0$ and equals
      ``dual_clip=C`` in value and gradient. A cap below $1 + \varepsilon_{\mathrm{high}}$
      also lowers the clipped term. Off by default.

    With `old_token_logps` None (on-policy, one gradient step per batch) the ratio is 1 in
    value, the loss is $-A_t$ and its gradient $-A_t \nabla \log \pi_\theta(y_t)$: REINFORCE
    with the baseline folded into the advantage.

    Args:
      token_logps: `[B, T]` current-policy log-probs of the sampled tokens (differentiated).
      old_token_logps: `[B, T]` behaviour-policy log-probs, or None for on-policy data.
      advantages: `[B]` (one per sequence, GRPO-style, applied to all its tokens) or `[B, T]`
        (per token, PPO/GAE-style); any other shape is a `ValueError`.
      level: ``"token"``, ``"sequence"`` (GSPO) or ``"sequence_token"`` (GSPO-token); static.
      epsilon_low: $\varepsilon_{\mathrm{low}} \ge 0$; may be traced.
      epsilon_high: $\varepsilon_{\mathrm{high}} \ge 0$; may be traced.
      dual_clip: $c > 1$, or None; may be traced.
      ratio_cap: $C > 0$, or None; may be traced.
      log_ratio_clamp: bound on the log-ratio before `exp` (see `importance_ratio`); may be
        traced.
      where: `[B, T]` mask, True (or 1) = counts. Masked tokens give exactly 0 and a zero
        gradient, even with NaN or infinite inputs there.

    Returns:
      `[B, T]` per-token losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import policy_gradient_loss
      >>> logps = jnp.log(jnp.array([[0.5, 0.9, 0.2]]))
      >>> old = jnp.log(jnp.array([[0.5, 0.5, 0.5]]))  # ratios 1.0, 1.8, 0.4
      >>> print(policy_gradient_loss(logps, old, jnp.array([1.0])).round(4))
      [[-1.  -1.2 -0.4]]
      >>> print(policy_gradient_loss(logps, old, jnp.array([-1.0])).round(4))
      [[1.  1.8 0.8]]
      >>> print(policy_gradient_loss(logps, old, jnp.array([-1.0]), dual_clip=1.5).round(4))
      [[1.  1.5 0.8]]

    References:
      Schulman et al., "Proximal Policy Optimization Algorithms", 2017,
      https://arxiv.org/abs/1707.06347.
      Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
      Language Models" (GRPO), 2024, https://arxiv.org/abs/2402.03300.
      Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", 2025,
      https://arxiv.org/abs/2503.14476.
      Zheng et al., "Group Sequence Policy Optimization", 2025,
      https://arxiv.org/abs/2507.18071.
      Ye et al., "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"
      (dual clip), 2020, https://arxiv.org/abs/1912.09729.
      Prime Intellect Team, "INTELLECT-2: A Reasoning Model Trained Through Globally
      Decentralized Reinforcement Learning", 2025, https://arxiv.org/abs/2505.07291.
    """
    v.one_of(level, "level", RATIO_LEVELS)
    v.non_negative(epsilon_low, "epsilon_low")
    v.non_negative(epsilon_high, "epsilon_high")
    if dual_clip is not None:
        v.greater_than_one(dual_clip, "dual_clip")
    if ratio_cap is not None:
        v.positive_scalar(ratio_cap, "ratio_cap")
    v.positive_scalar(log_ratio_clamp, "log_ratio_clamp")
    logps, old, where = v.behaviour_logps(token_logps, old_token_logps, where)
    adv = v.advantages_array(advantages, where, logps.dtype)
    dtype = adv.dtype
    ratio = ratio_from_logps(logps.astype(dtype), old.astype(dtype), where, level, log_ratio_clamp)
    clipped = jnp.clip(
        ratio, 1 - jnp.asarray(epsilon_low, dtype), 1 + jnp.asarray(epsilon_high, dtype)
    )
    if ratio_cap is not None:
        cap = jnp.asarray(ratio_cap, dtype)
        ratio = jnp.where(ratio > cap, cap, ratio)
        clipped = jnp.where(clipped > cap, cap, clipped)
    unclipped_objective, clipped_objective = ratio * adv, clipped * adv
    loss = -jnp.where(
        clipped_objective < unclipped_objective, clipped_objective, unclipped_objective
    )
    if dual_clip is not None:
        bound = -jnp.asarray(dual_clip, dtype) * adv
        loss = jnp.where((adv < 0) & (loss > bound), bound, loss)
    return jnp.where(where, loss, 0.0)


def cispo_loss(
    token_logps: Float[ArrayLike, "B T"],
    old_token_logps: Float[ArrayLike, "B T"],
    advantages: Float[ArrayLike, " B"] | Float[ArrayLike, "B T"],
    *,
    level: RatioLevel = "token",
    epsilon_low: Scalar = 1.0,
    epsilon_high: Scalar | None = None,
    ratio_cap: Scalar | None = None,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""CISPO: a REINFORCE loss weighted by the clipped, stop-gradient importance ratio.

    $$
    \ell_t = -\,\mathrm{sg}\big[\mathrm{clip}(r_t, 1 - \varepsilon_{\mathrm{low}}, U)\big] \,
             A_t \, \log \pi_\theta(y_t),
    \qquad U = \begin{cases} C & \text{if a ratio cap } C \text{ is given} \\
               1 + \varepsilon_{\mathrm{high}} & \text{otherwise} \end{cases}
    $$

    with $r_t$ the importance ratio of `token_logps` ($\log \pi_\theta$) over
    `old_token_logps` at `level` (see `importance_ratio`), $A_t$ = `advantages`,
    $\varepsilon_{\mathrm{low}}$ = `epsilon_low`, $\varepsilon_{\mathrm{high}}$ =
    `epsilon_high` and $C$ = `ratio_cap`. Unlike the PPO surrogate, which drops the gradient
    of tokens whose ratio left the trust region, CISPO clips only the weight, so every token
    keeps the gradient $-\mathrm{sg}[\hat r_t] A_t \nabla \log \pi_\theta(y_t)$. The value
    itself is a surrogate whose gradient is the point; MiniMax-M1 averages it over all tokens
    of the batch (``aggregate(mode="token_mean")``).

    `level`: ``"token"`` (MiniMax-M1's per-token ratio, the default) or ``"sequence"``, GSPO's
    length-normalised sequence ratio $s_i$, the same weight on every token of row $i$; as the
    weight carries no gradient, ``"sequence_token"`` gives exactly the value and gradient of
    ``"sequence"``. TRL (1.16) with ``importance_sampling_level="sequence"`` and
    ``loss_type="cispo"`` computes this sequence weight and then sums the per-token terms
    over the batch's tokens (its token mean over the accumulated batch,
    ``aggregate(mode="global_token_mean")``), which weighs each sequence by its length; TRL
    warns about this and points to the per-sequence mean
    (``aggregate(mode="seq_mean_token_mean")``) for GSPO's objective. Both reductions are
    available here; the per-token values are the same.

    The upper bound of the weight comes in two forms; give at most one:

    * relative, $1 + \varepsilon_{\mathrm{high}}$ (default `epsilon_high` = 3, a cap of 4,
      the default of Tinker's CISPO loss; verl's CISPO example uses 0.2, a cap of 1.2);
      MiniMax-M1 tunes only this bound and does not publish its value;
    * absolute, `ratio_cap` $= C$: TRL's (1.16) ``epsilon_high`` for ``loss_type="cispo"`` is the
      cap itself (``clamp(ratio, max=epsilon_high)``, ScaleRL's $\varepsilon_{\max}$, TRL
      recommends 5.0), so TRL's ``epsilon_high=5.0`` is ``ratio_cap=5.0`` here. TRL applies
      no lower bound for CISPO and ignores its ``epsilon``: keep the default
      `epsilon_low` = 1 for the same loss.

    Lower bound: MiniMax-M1 imposes none ("a large $\varepsilon_{\mathrm{low}}$"); our
    `epsilon_low` = 1 makes it 0, which a ratio never goes below. The weight is computed as
    $\exp(\min(\log r_t, \log U))$, so it is finite for any log-ratio.

    Args:
      token_logps: `[B, T]` current-policy log-probs of the sampled tokens (differentiated).
      old_token_logps: `[B, T]` behaviour-policy log-probs.
      advantages: `[B]` (one per sequence) or `[B, T]` (one per token).
      level: ``"token"``, ``"sequence"`` or ``"sequence_token"`` (static).
      epsilon_low: $\varepsilon_{\mathrm{low}} \ge 0$; may be traced.
      epsilon_high: $\varepsilon_{\mathrm{high}} \ge 0$, or None: 3 unless `ratio_cap` is
        given; may be traced.
      ratio_cap: $C > 0$, the absolute cap of the weight in place of
        $1 + \varepsilon_{\mathrm{high}}$, or None; may be traced.
      where: `[B, T]` mask, True (or 1) = counts; masked tokens give 0 and a zero gradient,
        and are left out of the sequence ratio.

    Returns:
      `[B, T]` per-token losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import cispo_loss
      >>> logps = jnp.log(jnp.array([[0.5, 0.9]]))
      >>> old = jnp.log(jnp.array([[0.5, 0.1]]))  # ratios 1 and 9: the weights are 1 and 4
      >>> grad = jax.grad(lambda x: cispo_loss(x, old, jnp.array([1.0])).sum())(logps)
      >>> print(grad.round(4))
      [[-1. -4.]]
      >>> # TRL's epsilon_high=5.0 for CISPO; the sequence ratio is sqrt(9) = 3 on both tokens.
      >>> def total(x):
      ...     return cispo_loss(x, old, jnp.array([1.0]), level="sequence", ratio_cap=5.0).sum()
      >>> print(jax.grad(total)(logps).round(4))
      [[-3. -3.]]

    References:
      MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
      Attention", 2025, https://arxiv.org/abs/2506.13585.
      Khatri et al., "The Art of Scaling Reinforcement Learning Compute for LLMs" (ScaleRL),
      2025, https://arxiv.org/abs/2510.13786.
      Zheng et al., "Group Sequence Policy Optimization", 2025,
      https://arxiv.org/abs/2507.18071.
    """
    v.one_of(level, "level", RATIO_LEVELS)
    if epsilon_high is not None and ratio_cap is not None:
        raise ValueError(
            "cispo_loss bounds the weight by 1 + epsilon_high or by ratio_cap, not both; got "
            f"epsilon_high={epsilon_high!r} and ratio_cap={ratio_cap!r}."
        )
    v.non_negative(epsilon_low, "epsilon_low")
    if epsilon_high is not None:
        v.non_negative(epsilon_high, "epsilon_high")
    if ratio_cap is not None:
        v.positive_scalar(ratio_cap, "ratio_cap")
    logps, old, where = v.behaviour_logps(token_logps, old_token_logps, where)
    adv = v.advantages_array(advantages, where, logps.dtype)
    dtype = adv.dtype
    logps = logps.astype(dtype)
    if ratio_cap is not None:
        high = jnp.asarray(ratio_cap, dtype)
    else:
        high = 1 + jnp.asarray(3.0 if epsilon_high is None else epsilon_high, dtype)
    log_ratio = lax.stop_gradient(logps - old.astype(dtype))
    if level != "token":
        count = jnp.maximum(jnp.sum(where, axis=-1, keepdims=True), 1).astype(dtype)
        log_ratio = jnp.broadcast_to(
            jnp.sum(log_ratio, axis=-1, keepdims=True) / count, logps.shape
        )
    weight = jnp.clip(
        jnp.exp(jnp.minimum(log_ratio, jnp.log(high))), 1 - jnp.asarray(epsilon_low, dtype), high
    )
    return jnp.where(where, -weight * adv * logps, 0.0)


def sapo_loss(
    token_logps: Float[ArrayLike, "B T"],
    old_token_logps: Float[ArrayLike, "B T"],
    advantages: Float[ArrayLike, " B"] | Float[ArrayLike, "B T"],
    *,
    level: RatioLevel = "token",
    tau_pos: Scalar = 1.0,
    tau_neg: Scalar = 1.05,
    log_ratio_clamp: Scalar = 20.0,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""SAPO: a smooth sigmoid gate of the importance ratio in place of PPO's hard clip.

    $$
    \ell_t = -f_t(r_t)\, A_t, \qquad
    f_t(x) = \frac{4}{\tau_t}\, \sigma\big(\tau_t (x - 1)\big), \qquad
    \tau_t = \begin{cases} \tau_{\mathrm{pos}} & A_t > 0 \\ \tau_{\mathrm{neg}} & A_t \le 0
    \end{cases}
    $$

    with $r_t$ the importance ratio of `token_logps` over `old_token_logps` at `level` (see
    `importance_ratio`), $A_t$ = `advantages`, $\tau_{\mathrm{pos}}$ = `tau_pos`,
    $\tau_{\mathrm{neg}}$ = `tau_neg` and $\sigma$ the logistic sigmoid. At ``"token"`` level
    (the paper's) its gradient is $-w_t A_t \nabla \log \pi_\theta(y_t)$ with
    $w_t = 4\, p_t (1 - p_t)\, r_t$, $p_t = \sigma(\tau_t (r_t - 1))$: the $4/\tau$ factor
    makes $w_t = 1$ on-policy ($r_t = 1$), so SAPO then matches the unclipped policy
    gradient, and the weight decays smoothly (like $e^{-\tau |r - 1|}$) as the ratio leaves 1
    on either side instead of dropping to 0 at a clip bound. A larger temperature decays
    faster; the paper sets $\tau_{\mathrm{neg}} > \tau_{\mathrm{pos}}$ because negative
    updates spread probability mass to many unsampled tokens and destabilise training, and
    uses $\tau_{\mathrm{pos}} = 1.0$, $\tau_{\mathrm{neg}} = 1.05$ (our defaults). The loss is
    bounded, $|\ell_t| \le 4 |A_t| / \tau_t$. The ratio is clamped as in `importance_ratio`.

    ``level="sequence"`` gates GSPO's length-normalised sequence ratio $s_i$ instead, the same
    value on every token of row $i$, whose gradient reaches every token of the row (through
    $\partial s_i / \partial \log \pi_\theta(y_{i,t}) = s_i / |y_i|$): TRL's (1.16)
    ``loss_type="sapo"`` with ``importance_sampling_level="sequence"``, which TRL reduces
    with the per-sequence token mean (``aggregate(mode="seq_mean_token_mean")``, one term
    per sequence). ``"sequence_token"`` has the same value with each token differentiating
    only through its own log-prob, as in GSPO-token.

    Args:
      token_logps: `[B, T]` current-policy log-probs of the sampled tokens (differentiated).
      old_token_logps: `[B, T]` behaviour-policy log-probs.
      advantages: `[B]` (one per sequence) or `[B, T]` (one per token).
      level: ``"token"``, ``"sequence"`` or ``"sequence_token"`` (static).
      tau_pos: $\tau_{\mathrm{pos}} > 0$, the gate temperature for positive advantages; may be
        traced.
      tau_neg: $\tau_{\mathrm{neg}} > 0$, the temperature for non-positive advantages; may be
        traced.
      log_ratio_clamp: bound on the log-ratio before `exp`; may be traced.
      where: `[B, T]` mask, True (or 1) = counts; masked tokens give 0 and a zero gradient,
        and are left out of the sequence ratio.

    Returns:
      `[B, T]` per-token losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import sapo_loss
      >>> logps = jnp.log(jnp.array([[0.5, 0.9]]))
      >>> old = jnp.log(jnp.array([[0.5, 0.3]]))  # ratios 1 and 3
      >>> print(sapo_loss(logps, old, jnp.array([1.0])).round(4))
      [[-2.     -3.5232]]
      >>> grad = jax.grad(lambda x: sapo_loss(x, old, jnp.array([1.0])).sum())(logps)
      >>> print(grad.round(4))  # weight 1 on-policy, 4 p (1 - p) r = 1.2598 at r = 3
      [[-1.     -1.2598]]
      >>> # The sequence ratio is sqrt(3) on both tokens.
      >>> print(sapo_loss(logps, old, jnp.array([1.0]), level="sequence").round(4))
      [[-2.701 -2.701]]

    References:
      Gao et al., "Soft Adaptive Policy Optimization", 2025,
      https://arxiv.org/abs/2511.20347.
      Zheng et al., "Group Sequence Policy Optimization", 2025,
      https://arxiv.org/abs/2507.18071.
    """
    v.one_of(level, "level", RATIO_LEVELS)
    v.positive_scalar(tau_pos, "tau_pos")
    v.positive_scalar(tau_neg, "tau_neg")
    v.positive_scalar(log_ratio_clamp, "log_ratio_clamp")
    logps, old, where = v.behaviour_logps(token_logps, old_token_logps, where)
    adv = v.advantages_array(advantages, where, logps.dtype)
    dtype = adv.dtype
    ratio = ratio_from_logps(logps.astype(dtype), old.astype(dtype), where, level, log_ratio_clamp)
    tau = jnp.where(adv > 0, jnp.asarray(tau_pos, dtype), jnp.asarray(tau_neg, dtype))
    gate = 4 / tau * jax.nn.sigmoid(tau * (ratio - 1))
    return jnp.where(where, -gate * adv, 0.0)
