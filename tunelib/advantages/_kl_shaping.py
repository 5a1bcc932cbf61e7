"""Reward shaping with a KL penalty towards a reference policy (RLHF, RLOO)."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Real

from tunelib import _deprecation
from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.losses import kl_penalty


@_deprecation.renamed_arguments(beta="kl_coef")
def kl_reward_shaping(
    rewards_t: Real[ArrayLike, "B T"],
    token_logps: Float[ArrayLike, "B T"],
    ref_token_logps: Float[ArrayLike, "B T"],
    *,
    kl_coef: Scalar,
    estimator: str = "k1",
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Per-token rewards with a KL penalty towards the reference policy subtracted.

    $$
    \tilde r_t = r_t - \beta \, \operatorname{sg}\big[\hat k_t\big],
    \qquad \hat k_1 = \log \pi(y_t) - \log \pi_{\mathrm{ref}}(y_t)
    $$

    with $r_t$ = `rewards_t`, $\log \pi$ = `token_logps` (the policy that sampled the tokens),
    $\log \pi_{\mathrm{ref}}$ = `ref_token_logps`, $\beta$ = `kl_coef`, $\hat k$ the per-token
    estimate of `tunelib.losses.kl_penalty` (with its default clamps) and sg the stop-gradient:
    the penalty is part of the reward, data for the advantage estimator, not a loss term.

    This is the KL-penalised reward of RLHF with PPO (Ziegler et al. 2019; Ouyang et al. 2022,
    eq. 2, $r_\phi(x, y) - \beta \log(\pi^{RL}(y \mid x) / \pi^{SFT}(y \mid x))$, spread over
    tokens) and of RLOO (Ahmadian et al. 2024), which use k1 (the default here): the
    sequence-level penalty is the sum of the per-token ones, so with the task reward on the
    last token (`sequence_rewards_to_tokens`) the return of each sequence is
    $r - \beta \sum_t \hat k_t$. With k1 the policy gradient of this reward is the exact gradient
    of the KL-regularised objective, because $\mathbb{E}_\pi[\nabla k_1] = 0$; with k3 (TRL's
    PPO ``kl_estimator="k3"``) the value has lower variance but that identity fails.

    This function was `tunelib.losses.kl_reward_shaping` with the coefficient named `beta`;
    both old forms still work until tunelib 0.3.0, with a `DeprecationWarning`.

    Args:
      rewards_t: `[B, T]` per-token rewards, integer or float (cast, never truncated).
      token_logps: `[B, T]` log-probabilities of the sampled tokens under the sampling policy.
      ref_token_logps: `[B, T]` log-probabilities of the same tokens under the reference policy.
      kl_coef: $\beta \ge 0$, the KL coefficient; may be traced (for an adaptive controller).
      estimator: ``"k1"`` (default), ``"k2"`` or ``"k3"``; see `tunelib.losses.kl_penalty`.
      where: `[B, T]` mask, True (or 1) = a completion token that counts; masked tokens give
        exactly 0, even when their inputs are NaN or infinite.

    Returns:
      `[B, T]` shaped rewards, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import kl_reward_shaping
      >>> rewards = jnp.array([[0, 0, 1]])  # the task reward on the last token
      >>> logps, ref_logps = jnp.array([[-1.0, -2.0, -0.5]]), jnp.array([[-1.5, -1.0, -0.5]])
      >>> print(kl_reward_shaping(rewards, logps, ref_logps, kl_coef=0.1).round(4))
      [[-0.05  0.1   1.  ]]

    References:
      Ziegler et al., "Fine-Tuning Language Models from Human Preferences", 2019,
      https://arxiv.org/abs/1909.08593.
      Ouyang et al., "Training language models to follow instructions with human feedback",
      2022, https://arxiv.org/abs/2203.02155.
      Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
      from Human Feedback in LLMs", 2024, https://arxiv.org/abs/2402.14740.
    """
    rewards = jnp.asarray(rewards_t)
    if not (
        jnp.issubdtype(rewards.dtype, jnp.integer) or jnp.issubdtype(rewards.dtype, jnp.floating)
    ):
        raise TypeError(
            f"rewards_t must be an integer or floating-point array, got dtype {rewards.dtype}."
        )
    v.non_negative(kl_coef, "kl_coef")
    kl = kl_penalty(token_logps, ref_token_logps, estimator=estimator, where=where)
    v.check_shape(rewards, "rewards_t", kl.shape, f"token_logps {kl.shape}")
    where = v.mask_array(where, kl.shape)
    float_dtypes = [rewards.dtype] if jnp.issubdtype(rewards.dtype, jnp.floating) else []
    dtype = v.compute_dtype(kl.dtype, *float_dtypes)
    rewards = jnp.where(where, rewards.astype(dtype), 0.0)
    shaped = rewards - jnp.asarray(kl_coef, dtype) * jax.lax.stop_gradient(kl.astype(dtype))
    return jnp.where(where, shaped, 0.0)
