r"""Correcting for the mismatch between the sampler's and the trainer's log-probs.

An inference engine (the sampler) and the training forward pass compute slightly different
probabilities for the same tokens under the same weights (different kernels, precision,
batching, MoE routing), so "on-policy" RL is in fact off-policy. The importance weight
$\pi_{\mathrm{train}}(y_t) / \pi_{\mathrm{sampler}}(y_t)$, truncated or used as a filter,
corrects for it.
"""

from typing import Literal

import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.losses._rollout_correction import level_log_ratios

WeightLevel = Literal["token", "sequence", "geometric"]
WEIGHT_LEVELS: tuple[str, ...] = WeightLevel.__args__
WeightMode = Literal["truncate", "mask"]
WEIGHT_MODES: tuple[str, ...] = WeightMode.__args__


def truncated_importance_weights(
    token_logps: Float[ArrayLike, "B T"],
    sampler_token_logps: Float[ArrayLike, "B T"],
    *,
    level: WeightLevel = "token",
    mode: WeightMode = "truncate",
    cap: Scalar = 2.0,
    floor: Scalar | None = None,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Stop-gradient importance weights of the trainer over the sampler, truncated or masked.

    $$
    \rho = \frac{\pi_{\mathrm{train}}(y)}{\pi_{\mathrm{sampler}}(y)}, \qquad
    w = \begin{cases}
      \min(\rho, C) & \text{``truncate''} \\
      \rho \cdot \mathbb{1}[\rho_{\min} \le \rho \le C] & \text{``mask''}
    \end{cases}
    $$

    with $\log \pi_{\mathrm{train}}$ = `token_logps`, $\log \pi_{\mathrm{sampler}}$ =
    `sampler_token_logps`, $C$ = `cap` and $\rho_{\min}$ = `floor` (0 when None). The ratio
    $\rho$ depends on `level`:

    * ``"token"``: $\rho_t = \pi_{\mathrm{train}}(y_t) / \pi_{\mathrm{sampler}}(y_t)$, one
      weight per token: truncated importance sampling (TIS) of Yao et al. 2025, who cap at
      $C = 2$ (our default).
    * ``"sequence"``: the product over the valid tokens of the row,
      $\rho_i = \exp \sum_t (\log \pi_{\mathrm{train}} - \log \pi_{\mathrm{sampler}})$, the
      unbiased sequence-level weight; with ``mode="mask"`` this is the sequence-level masked
      importance sampling (MIS) of Liu et al. 2025, which drops whole sequences whose weight
      exceeds $C$. A product over thousands of tokens varies far more than a token ratio, so
      its cap is usually larger.
    * ``"geometric"``: the geometric mean of the token ratios,
      $\rho_i = \exp \frac{1}{|y_i|} \sum_t (\ldots)$, length-normalised like GSPO's ratio:
      with ``mode="mask"`` and thresholds close to 1 this is the geometric sequence masking
      (Geo-MIS) that Liu et al. added later and DeepSeek-V3.2 adopts; biased, but its scale
      does not grow with the length.

    Sequence-level weights are the same on every valid token of the row. Multiply the
    per-token policy loss by $w$ (for PPO, pass the trainer's recomputed behaviour log-probs
    `old_token_logps` as `token_logps`, as Yao et al. do). The weights carry no gradient.
    They are computed in log space, $w = \exp(\min(\log \rho, \log C))$, so they are finite
    for any log-ratio.

    Args:
      token_logps: `[B, T]` trainer log-probs of the sampled tokens.
      sampler_token_logps: `[B, T]` log-probs the inference engine reported for them.
      level: ``"token"``, ``"sequence"`` or ``"geometric"`` (static).
      mode: ``"truncate"`` (TIS: $\min(\rho, C)$) or ``"mask"`` (MIS: $\rho$ where it lies in
        $[\rho_{\min}, C]$, else 0); static.
      cap: $C > 0$; may be traced.
      floor: $\rho_{\min} > 0$ for ``mode="mask"``: a two-sided mask that also drops tokens or
        sequences the trainer finds much less likely than the sampler did (Liu et al.'s dual
        masking); None = no lower bound. Rejected by ``"truncate"``. May be traced.
      where: `[B, T]` mask, True (or 1) = counts. Masked tokens get weight 0 and are left out
        of the sequence sums, even when their log-probs are NaN or infinite.

    Returns:
      `[B, T]` weights in $[0, C]$, float32 (float64 for float64 input), without gradient.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import truncated_importance_weights
      >>> train = jnp.log(jnp.array([[0.5, 0.9, 0.2]]))
      >>> sampler = jnp.log(jnp.array([[0.5, 0.3, 0.4]]))  # ratios 1, 3, 0.5
      >>> print(truncated_importance_weights(train, sampler).round(4))
      [[1.  2.  0.5]]
      >>> print(truncated_importance_weights(train, sampler, mode="mask").round(4))
      [[1.  0.  0.5]]
      >>> print(truncated_importance_weights(train, sampler, level="sequence", cap=5.0).round(4))
      [[1.5 1.5 1.5]]

    References:
      Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
      2025, https://fengyao.notion.site/off-policy-rl.
      Liu et al., "When Speed Kills Stability: Demystifying RL Collapse from the
      Training-Inference Mismatch", 2025,
      https://yingru.notion.site/When-Speed-Kills-Stability-271211a558b7808d8b12d403fd15edda.
      DeepSeek-AI, "DeepSeek-V3.2", 2025, https://arxiv.org/abs/2512.02556.
    """
    v.one_of(level, "level", WEIGHT_LEVELS)
    if mode not in WEIGHT_MODES:
        raise ValueError(f"mode must be one of {WEIGHT_MODES}, got {mode!r}.")
    if floor is not None and mode != "mask":
        raise ValueError(f"floor is used only by mode 'mask'; got mode={mode!r}.")
    v.positive_scalar(cap, "cap")
    if floor is not None:
        v.positive_scalar(floor, "floor")
    (logps, sampler), where = v.masked_floats(
        where, ndim=2, token_logps=token_logps, sampler_token_logps=sampler_token_logps
    )
    log_rho = level_log_ratios(lax.stop_gradient(logps - sampler), where, level)
    log_cap = jnp.log(jnp.asarray(cap, logps.dtype))
    weights = jnp.exp(jnp.minimum(log_rho, log_cap))
    if mode == "mask":
        keep = log_rho <= log_cap
        if floor is not None:
            keep &= log_rho >= jnp.log(jnp.asarray(floor, logps.dtype))
        weights = jnp.where(keep, weights, 0.0)
    return jnp.where(where, weights, 0.0)


def off_policy_sequence_mask(
    token_logps: Float[ArrayLike, "B T"],
    sampler_token_logps: Float[ArrayLike, "B T"],
    advantages: Float[ArrayLike, " B"] | Float[ArrayLike, "B T"],
    *,
    threshold: Scalar,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Bool[Array, "B T"]:
    r"""DeepSeek-V3.2's off-policy sequence mask: drop negative-advantage sequences that drifted.

    $$
    M_{i,t} = \begin{cases}
      0 & A_{i,t} < 0 \text{ and } \frac{1}{|y_i|} \sum_{u} \big(\log \pi_{\mathrm{sampler}}
          (y_{i,u}) - \log \pi_\theta(y_{i,u})\big) > \delta \\
      1 & \text{otherwise}
    \end{cases}
    $$

    with $\log \pi_\theta$ = `token_logps`, $\log \pi_{\mathrm{sampler}}$ =
    `sampler_token_logps`, $A_{i,t}$ = `advantages`, $\delta$ = `threshold` and the mean over
    the $|y_i|$ valid tokens of row $i$ (from `where`): a sample estimate of
    $\mathrm{KL}(\pi_{\mathrm{sampler}} \,\|\, \pi_\theta)$ on the sequence. A completion
    the sampler generated but the current policy now finds much less likely, and that was
    penalised, is left out: its negative gradient comes from a distribution the policy has
    already moved away from, and DeepSeek-V3.2 reports that such samples destabilise
    training. Positive-advantage sequences are always kept.

    Multiply the per-token policy loss by the mask, as TRL (1.16, ``off_policy_mask_threshold``)
    does: the dropped tokens then stay in the reduction's denominators, like tokens with zero
    loss. Passing ``where & mask`` to `aggregate` instead removes them from the denominators
    too. TRL compares the current log-probs with the sampler's (vLLM's) where it has them and
    with the trainer's `old_token_logps` otherwise; pass whichever log-probs the completions
    were sampled under. With `[B]` advantages the mask is constant on each row; with `[B, T]`
    advantages it is decided per token, as in the paper's formula (and TRL's) with per-token
    advantages. A NaN log-prob at a counted token (one the sampler could not score) adds no
    drift but still counts in $|y_i|$, as in TRL; masked tokens are left out.

    Args:
      token_logps: `[B, T]` log-probs of the sampled tokens under the current policy (no
        gradient flows through the mask).
      sampler_token_logps: `[B, T]` log-probs under the policy that sampled them.
      advantages: `[B]` (one per sequence) or `[B, T]` (one per token).
      threshold: $\delta \ge 0$, in nats per token. Neither the paper nor TRL fixes a value
        (TRL's documentation suggests 0.5), so it has no default; may be traced.
      where: `[B, T]` mask, True (or 1) = counts. Masked tokens are False in the result and
        left out of the mean, even when their log-probs are NaN or infinite.

    Returns:
      `[B, T]` boolean mask, True = keep; False on masked tokens.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import off_policy_sequence_mask
      >>> logps = jnp.array([[-2.0, -2.0], [-2.0, -2.0], [-0.5, -0.5]])
      >>> sampler = jnp.array([[-1.0, -1.0], [-1.0, -1.0], [-0.4, -0.6]])  # drift 1, 1, 0
      >>> print(off_policy_sequence_mask(logps, sampler, jnp.array([-1.0, 1.0, -1.0]),
      ...                                threshold=0.5))
      [[False False]
       [ True  True]
       [ True  True]]

    References:
      DeepSeek-AI, "DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models", 2025,
      sec. 3.1, https://arxiv.org/abs/2512.02556.
    """
    v.non_negative(threshold, "threshold")
    (logps, sampler), where = v.masked_floats(
        where, ndim=2, token_logps=token_logps, sampler_token_logps=sampler_token_logps
    )
    adv = v.advantages_array(advantages, where, logps.dtype)
    count = jnp.maximum(jnp.sum(where, axis=-1, keepdims=True), 1).astype(logps.dtype)
    token_drift = lax.stop_gradient(sampler - logps)
    token_drift = jnp.where(jnp.isnan(token_drift), 0.0, token_drift)
    drift = jnp.sum(token_drift, axis=-1, keepdims=True) / count
    drop = (adv < 0) & (drift > jnp.asarray(threshold, logps.dtype))
    return where & ~drop
