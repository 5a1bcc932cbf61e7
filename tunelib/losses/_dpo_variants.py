r"""DPO under other divergences (f-DPO) and on length-desensitised log-probabilities (LD-DPO).

f-DPO replaces each log-ratio $r = \log \pi_\theta(y) / \pi_{\mathrm{ref}}(y)$ of DPO by
$f'(\pi_\theta(y) / \pi_{\mathrm{ref}}(y))$, the derivative of the generator of the
f-divergence that regularises the policy; reverse KL gives back DPO. LD-DPO keeps DPO's loss
and changes the sequence log-probabilities it is given: the tokens past the shorter
completion's length weigh $\alpha$. Both also feed any other loss on the DPO margin.
"""

import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.losses._dpo_family import dpo_margin, pair_logps, with_pair_arguments

FDivergence = Literal["reverse_kl", "forward_kl", "jsd", "alpha_divergence"]
F_DPO_DIVERGENCES: tuple[str, ...] = FDivergence.__args__

# The largest exponent of a power transform: e^80 (about 5.5e34) and anything it is multiplied
# by stay finite in float32. TRL caps its alpha-divergence exponent at the same value.
MAX_EXPONENT = 80.0


def power_transform(x: jax.Array, alpha: ArrayLike) -> jax.Array:
    r"""$(1 - e^{-\alpha x}) / \alpha$, and $x$ at $\alpha = 0$; the exponent capped at 80.

    With $x = \log u$ this is $(1 - u^{-\alpha}) / \alpha$: f-DPO's $f'(u)$ for the
    $\alpha$-divergence (with $x$ a log-ratio) and AlphaPO's reward (with $x$ a log-probability).
    It is computed as $x \cdot \mathrm{expm1}(t)/t$ with $t = -\alpha x$ (1 at $t = 0$), which
    stays accurate when $\alpha x$ is tiny or flushed to 0, and continuous through
    $\alpha = 0$, so $\alpha$ may be traced. Above the cap, $t > 80$, it is the constant
    $-\mathrm{expm1}(80)/\alpha$.
    """
    alpha = jnp.asarray(alpha, x.dtype)
    t = -alpha * x
    capped = t > MAX_EXPONENT
    small = t == 0
    safe_t = jnp.where(small | capped, 1.0, t)
    ratio = jnp.where(small, 1.0, jnp.expm1(safe_t) / safe_t)  # expm1(t) / t, 1 at t = 0
    cap = -jnp.expm1(jnp.asarray(MAX_EXPONENT, x.dtype)) / jnp.where(capped, alpha, 1.0)
    return jnp.where(capped, cap, x * ratio)


def _scores(log_ratios: jax.Array, divergence: str, alpha: ArrayLike) -> jax.Array:
    """f'(u) of `divergence` at u = exp(log_ratios)."""
    if divergence == "reverse_kl":
        return log_ratios
    if divergence == "forward_kl":
        return power_transform(log_ratios, 1.0)
    if divergence == "jsd":
        return math.log(2.0) + jax.nn.log_sigmoid(log_ratios)
    return power_transform(log_ratios, alpha)


def _check_divergence(divergence: str, alpha: ArrayLike) -> None:
    v.one_of(divergence, "divergence", F_DPO_DIVERGENCES)
    v.finite_number(alpha, "alpha")


def f_dpo_scores(
    logps: Float[ArrayLike, " B"],
    ref_logps: Float[ArrayLike, " B"],
    *,
    divergence: FDivergence = "reverse_kl",
    alpha: Scalar = 0.5,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""f-DPO's score of a completion: $f'$ of its policy-to-reference probability ratio.

    $$
    s = f'(u), \qquad u = \frac{\pi_\theta(y)}{\pi_{\mathrm{ref}}(y)}, \qquad
    f'(u) = \begin{cases}
      \log u & \text{reverse KL} \\
      1 - u^{-1} & \text{forward KL} \\
      \log \frac{2u}{1 + u} & \text{Jensen-Shannon} \\
      \frac{1 - u^{-\alpha}}{\alpha} & \alpha\text{-divergence}
    \end{cases}
    $$

    with $\log \pi_\theta(y)$ = `logps`, $\log \pi_{\mathrm{ref}}(y)$ = `ref_logps`, the
    divergence = `divergence` and $\alpha$ = `alpha`. The reverse KL's score is the log-ratio
    $r = \log u$ itself (the constant 1 of $f'(u) = \log u + 1$ cancels in every margin), so
    DPO is f-DPO under the reverse KL. The Jensen-Shannon score is computed as
    $\log 2 + \log \sigma(r)$, and the others as $-\mathrm{expm1}(-\alpha r)/\alpha$ with the
    exponent $-\alpha r$ capped at 80 (the forward KL is $\alpha = 1$), as TRL caps its
    $\alpha$-divergence: the score stays finite, and where $-\alpha r > 80$ (below
    $r = -80/\alpha$ for $\alpha > 0$) it is constant with a zero gradient.

    Scores replace the log-ratios of any loss on the DPO margin: `f_dpo_loss` is
    `dpo_loss(s_w, s_l, 0, 0)` with $\beta$ and no label smoothing, and TRL's
    `f_divergence_type` with another `loss_type` is that loss on the scores, e.g.
    `hinge_loss(s_w, s_l, zeros, zeros, beta=beta)` for `"hinge"` (TRL 1.16 allows it for
    `"sigmoid"`, `"sigmoid_norm"`, `"hinge"`, `"ipo"`, `"exo_pair"`, `"robust"`, `"discopop"`
    and `"sft"`; its `"ipo"` and `"sigmoid_norm"` divide the scores by the token counts
    first).

    The $\alpha$-divergence's parametrisation differs between the paper and TRL. Here and in
    the paper, $\alpha \to 0$ is the reverse KL and $\alpha = 1$ the forward KL, and so it was
    in TRL up to 0.28. TRL 1.16 computes $(u^{a - 1} - 1)/(a - 1)$ for
    `f_alpha_divergence_coef` $= a$, which is $\alpha = 1 - a$ here; the defaults, 0.5,
    coincide.

    Args:
      logps: `[B]` policy log-probabilities of the completions (sums over tokens).
      ref_logps: `[B]` reference-policy log-probabilities of the same completions.
      divergence: ``"reverse_kl"`` (default, DPO), ``"forward_kl"``, ``"jsd"`` or
        ``"alpha_divergence"`` (static); TRL's `f_divergence_type` names the last two
        ``"js_divergence"`` and ``"alpha_divergence"``.
      alpha: the $\alpha$ of ``"alpha_divergence"``, a finite number, ignored by the other
        divergences. The paper takes $\alpha \in (0, 1)$; the default 0.5 is TRL's. May be
        traced; $\alpha = 0$ gives the reverse KL's score exactly.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` scores, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import f_dpo_scores
      >>> logps, ref_logps = jnp.array([-10.0, -12.0]), jnp.array([-11.0, -12.0])
      >>> for divergence in ("reverse_kl", "forward_kl", "jsd", "alpha_divergence"):
      ...     s = f_dpo_scores(logps, ref_logps, divergence=divergence)
      ...     print(divergence, s.round(4).tolist())
      reverse_kl [1.0, 0.0]
      forward_kl [0.6321, 0.0]
      jsd [0.3799, 0.0]
      alpha_divergence [0.7869, 0.0]

    References:
      Wang et al., "Beyond Reverse KL: Generalizing Direct Preference Optimization with
      Diverse Divergence Constraints", 2023, https://arxiv.org/abs/2309.16240.
    """
    _check_divergence(divergence, alpha)
    (logps, ref_logps), where = v.masked_floats(where, ndim=1, logps=logps, ref_logps=ref_logps)
    return jnp.where(where, _scores(logps - ref_logps, divergence, alpha), 0.0)


@with_pair_arguments
def f_dpo_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    divergence: FDivergence = "reverse_kl",
    alpha: Scalar = 0.5,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""f-DPO: DPO with the reverse KL to the reference replaced by another f-divergence.

    $$
    \ell = -\log \sigma\!\Big(\beta f'\Big(\frac{\pi_\theta(y_w)}{\pi_{\mathrm{ref}}(y_w)}\Big)
                            - \beta f'\Big(\frac{\pi_\theta(y_l)}{\pi_{\mathrm{ref}}(y_l)}\Big)
                      \Big)
    $$

    with $\log \pi_\theta(y_w)$ = `chosen_logps`, $\log \pi_\theta(y_l)$ = `rejected_logps`,
    $\log \pi_{\mathrm{ref}}(y_w)$ = `ref_chosen_logps`, $\log \pi_{\mathrm{ref}}(y_l)$ =
    `ref_rejected_logps`, $\beta$ = `beta` and $f'$ the derivative of the generator of
    `divergence` (with `alpha` for the $\alpha$-divergence), as `f_dpo_scores` lists them.
    The policy that maximises the reward under an f-divergence penalty has
    $\beta f'(\pi^*/\pi_{\mathrm{ref}})$ as its implicit reward, up to a constant; the
    Bradley-Terry likelihood of that reward is the loss. Under the reverse KL it is
    `dpo_loss`. The forward KL and small $\alpha$ penalise the policy for dropping what the
    reference covers more than for moving elsewhere, which the paper finds keeps more diversity
    at some cost in reward (TRL 1.16: `f_divergence_type` with `loss_type="sigmoid"`).

    Args:
      beta: $\beta > 0$; may be traced.
      divergence: ``"reverse_kl"`` (default, DPO), ``"forward_kl"``, ``"jsd"`` or
        ``"alpha_divergence"`` (static).
      alpha: the $\alpha$ of ``"alpha_divergence"`` in the paper's parametrisation (TRL 1.16's
        `f_alpha_divergence_coef` is $1 - \alpha$; see `f_dpo_scores`); default 0.5; may be
        traced.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import f_dpo_loss
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])
      >>> ref_chosen, ref_rejected = jnp.array([-11.0, -12.0]), jnp.array([-13.0, -12.0])
      >>> for divergence in ("reverse_kl", "forward_kl", "jsd"):
      ...     loss = f_dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5,
      ...                       divergence=divergence)
      ...     print(divergence, loss.round(4).tolist())
      reverse_kl [0.3133, 0.9741]
      forward_kl [0.2691, 0.8636]
      jsd [0.4741, 0.7926]

    References:
      Wang et al., "Beyond Reverse KL: Generalizing Direct Preference Optimization with
      Diverse Divergence Constraints", 2023, https://arxiv.org/abs/2309.16240.
    """
    v.positive_scalar(beta, "beta")
    _check_divergence(divergence, alpha)
    (chosen, rejected, ref_chosen, ref_rejected), where = pair_logps(
        (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps), where
    )
    margin = _scores(chosen - ref_chosen, divergence, alpha) - _scores(
        rejected - ref_rejected, divergence, alpha
    )
    loss = -jax.nn.log_sigmoid(jnp.asarray(beta, margin.dtype) * margin)
    return jnp.where(where, loss, 0.0)


# LD-DPO: the sequence log-probabilities with the tail past the shared length down-weighted.


def token_pairs(
    chosen: dict[str, ArrayLike],
    rejected: dict[str, ArrayLike],
    chosen_where: ArrayLike | None,
    rejected_where: ArrayLike | None,
    where: ArrayLike | None,
) -> tuple[list[jax.Array], jax.Array, list[jax.Array], jax.Array, jax.Array]:
    """Checked per-token arrays of the chosen `[B, Tc]` and the rejected `[B, Tr]` completions.

    Returns the chosen arrays and their mask, the rejected arrays and their mask, each mask
    already combined with the pair mask `where` `[B]`, every masked entry 0; and `where`.
    """
    chosen_arrays, _ = v.masked_floats(None, ndim=2, **chosen)
    rejected_arrays, _ = v.masked_floats(None, ndim=2, **rejected)
    chosen_name, rejected_name = next(iter(chosen)), next(iter(rejected))
    chosen_shape, rejected_shape = chosen_arrays[0].shape, rejected_arrays[0].shape
    if rejected_shape[0] != chosen_shape[0]:
        raise ValueError(
            f"{rejected_name} has {rejected_shape[0]} rows (shape {tuple(rejected_shape)}) but "
            f"{chosen_name} has {chosen_shape[0]} (shape {tuple(chosen_shape)}): row i of both "
            "is one preference pair."
        )
    where = v.mask_array(where, chosen_shape[:1])
    chosen_mask = v.mask_array(chosen_where, chosen_shape, "chosen_where") & where[:, None]
    rejected_mask = v.mask_array(rejected_where, rejected_shape, "rejected_where") & where[:, None]
    chosen_arrays = [jnp.where(chosen_mask, x, 0.0) for x in chosen_arrays]
    rejected_arrays = [jnp.where(rejected_mask, x, 0.0) for x in rejected_arrays]
    return chosen_arrays, chosen_mask, rejected_arrays, rejected_mask, where


def _desensitized(
    token_logps: jax.Array, mask: jax.Array, shared: jax.Array, tail_weight: jax.Array
) -> jax.Array:
    """Sum of the first `shared` valid tokens plus `tail_weight` times the sum of the rest."""
    rank = jnp.cumsum(mask, axis=-1)  # the valid tokens' 1-based positions in the completion
    in_tail = rank > shared[:, None]
    head = jnp.sum(jnp.where(in_tail, 0.0, token_logps), axis=-1)
    tail = jnp.sum(jnp.where(in_tail, token_logps, 0.0), axis=-1)
    return head + tail_weight * tail


def _check_tail_weight(tail_weight: ArrayLike) -> None:
    v.number_in(tail_weight, "tail_weight", low=0, high=1, explain="1 is DPO, 0 drops the tail")


def length_desensitized_logps(
    chosen_token_logps: Float[ArrayLike, "B Tc"],
    rejected_token_logps: Float[ArrayLike, "B Tr"],
    *,
    tail_weight: Scalar,
    chosen_where: Mask[ArrayLike, "B Tc"] | None = None,
    rejected_where: Mask[ArrayLike, "B Tr"] | None = None,
    where: Mask[ArrayLike, " B"] | None = None,
) -> tuple[Float[Array, " B"], Float[Array, " B"]]:
    r"""LD-DPO's sequence log-probabilities: the tokens past the shorter completion weigh $\alpha$.

    $$
    \log \hat\pi(y) = \sum_{t=1}^{\ell_p} \log \pi(y_t \mid x, y_{<t})
                    + \alpha \sum_{t=\ell_p + 1}^{|y|} \log \pi(y_t \mid x, y_{<t}),
    \qquad \ell_p = \min(|y_w|, |y_l|)
    $$

    for $y = y_w$ (`chosen_token_logps`) and $y = y_l$ (`rejected_token_logps`) of each pair,
    with $\alpha$ = `tail_weight`, where $t$ counts the valid tokens of the completion
    (`chosen_where`, `rejected_where`) in order and $|y|$ is their number. The first
    $\ell_p$ tokens of both completions are the "public" part that both have; the rest of the
    longer completion is its excess length, whose likelihood DPO's margin would otherwise
    add in full. Apply it to the policy's and to the reference's token log-probs with the
    same masks and pass the four results to `dpo_loss` (that is
    `length_desensitized_dpo_loss`) or to any other loss of the DPO family, as TRL's
    `ld_alpha` does for every `loss_type` (TRL 1.16, `DPOTrainer._compute_loss`, which
    counts positions by the cumulative sum of the completion mask as here).

    Args:
      chosen_token_logps: `[B, Tc]` per-token log-probabilities of the chosen completions.
      rejected_token_logps: `[B, Tr]` per-token log-probabilities of the rejected
        completions; row $i$ is the same pair as row $i$ of the chosen ones (the widths may
        differ).
      tail_weight: $\alpha \in [0, 1]$, TRL's `ld_alpha`: 1 gives the plain sums (DPO), 0
        truncates the longer completion to the shorter one's length. It has no default: the
        paper tunes it per model, lower for models that drift to longer answers. May be
        traced.
      chosen_where: `[B, Tc]` mask of the chosen completions' tokens (True on the completion,
        the EOS token included; False on prompt and padding); None = every token.
      rejected_where: `[B, Tr]` mask of the rejected completions' tokens.
      where: `[B]` mask of the pairs, True (or 1) = counts; masked pairs give 0 and a zero
        gradient.

    Returns:
      A tuple `(chosen_logps, rejected_logps)` of `[B]` arrays, float32 (float64 for float64
      input). Masked tokens and pairs contribute exactly 0, even when they are NaN or
      infinite.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import length_desensitized_logps
      >>> chosen = jnp.array([[-1.0, -2.0, -3.0, -4.0]])  # 4 tokens
      >>> rejected = jnp.array([[-1.0, -1.0, 0.0]])  # 2 tokens and padding
      >>> mask = jnp.array([[True, True, False]])
      >>> c, r = length_desensitized_logps(chosen, rejected, tail_weight=0.5, rejected_where=mask)
      >>> print(c.tolist(), r.tolist())  # -1 - 2 + 0.5 * (-3 - 4), and the shorter in full
      [-6.5] [-2.0]

    References:
      Liu et al., "Length Desensitization in Direct Preference Optimization", 2024,
      https://arxiv.org/abs/2409.06411.
    """
    _check_tail_weight(tail_weight)
    (chosen,), chosen_mask, (rejected,), rejected_mask, _ = token_pairs(
        {"chosen_token_logps": chosen_token_logps},
        {"rejected_token_logps": rejected_token_logps},
        chosen_where,
        rejected_where,
        where,
    )
    shared = jnp.minimum(jnp.sum(chosen_mask, axis=-1), jnp.sum(rejected_mask, axis=-1))
    alpha = jnp.asarray(tail_weight, chosen.dtype)
    return (
        _desensitized(chosen, chosen_mask, shared, alpha),
        _desensitized(rejected, rejected_mask, shared, alpha),
    )


def length_desensitized_dpo_loss(
    chosen_token_logps: Float[ArrayLike, "B Tc"],
    rejected_token_logps: Float[ArrayLike, "B Tr"],
    ref_chosen_token_logps: Float[ArrayLike, "B Tc"],
    ref_rejected_token_logps: Float[ArrayLike, "B Tr"],
    *,
    tail_weight: Scalar,
    beta: Scalar = 0.1,
    chosen_where: Mask[ArrayLike, "B Tc"] | None = None,
    rejected_where: Mask[ArrayLike, "B Tr"] | None = None,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""LD-DPO: DPO on sequence log-probabilities whose excess length weighs $\alpha$.

    $$
    \ell = -\log \sigma\!\left(\beta \log \frac{\hat\pi_\theta(y_w)}{\hat\pi_{\mathrm{ref}}(y_w)}
                              - \beta \log \frac{\hat\pi_\theta(y_l)}{\hat\pi_{\mathrm{ref}}(y_l)}
                        \right)
    $$

    with $\log \hat\pi(y)$ the length-desensitised log-probability of
    `length_desensitized_logps` (the first $\min(|y_w|, |y_l|)$ valid tokens in full, the rest
    times $\alpha$ = `tail_weight`) of the policy's `chosen_token_logps` and
    `rejected_token_logps` and the reference's `ref_chosen_token_logps` and
    `ref_rejected_token_logps`, and $\beta$ = `beta`. The likelihood of the tokens that only
    the longer completion has grows with its length and, summed in full, lets DPO prefer
    length for its own sake; with $\alpha < 1$ it counts less. $\alpha = 1$ is `dpo_loss` on
    the sums (TRL 1.16: `ld_alpha` with `loss_type="sigmoid"`).

    Args:
      chosen_token_logps: `[B, Tc]` policy per-token log-probabilities of the chosen
        completions.
      rejected_token_logps: `[B, Tr]` policy per-token log-probabilities of the rejected ones.
      ref_chosen_token_logps: `[B, Tc]` reference per-token log-probabilities of the chosen
        completions.
      ref_rejected_token_logps: `[B, Tr]` reference per-token log-probabilities of the
        rejected ones.
      tail_weight: $\alpha \in [0, 1]$, TRL's `ld_alpha`; no default (see
        `length_desensitized_logps`). May be traced.
      beta: $\beta > 0$; the default 0.1 is DPO's. May be traced.
      chosen_where: `[B, Tc]` mask of the chosen completions' tokens; None = every token.
      rejected_where: `[B, Tr]` mask of the rejected completions' tokens.
      where: `[B]` mask of the pairs, True (or 1) = counts; masked pairs give 0 and a zero
        gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import length_desensitized_dpo_loss
      >>> chosen = jnp.array([[-1.0, -1.0, -2.0, -2.0]])
      >>> ref_chosen = jnp.array([[-1.0, -1.5, -1.0, -1.0]])
      >>> rejected, ref_rejected = jnp.array([[-2.0, -2.0]]), jnp.array([[-1.5, -1.5]])
      >>> for alpha in (1.0, 0.5, 0.0):  # the chosen completion's 2-token tail counts less
      ...     loss = length_desensitized_dpo_loss(
      ...         chosen, rejected, ref_chosen, ref_rejected, tail_weight=alpha, beta=1.0)
      ...     print(alpha, loss.round(4).tolist())
      1.0 [0.9741]
      0.5 [0.4741]
      0.0 [0.2014]

    References:
      Liu et al., "Length Desensitization in Direct Preference Optimization", 2024,
      https://arxiv.org/abs/2409.06411.
    """
    v.positive_scalar(beta, "beta")
    _check_tail_weight(tail_weight)
    chosen_arrays, chosen_mask, rejected_arrays, rejected_mask, where = token_pairs(
        {
            "chosen_token_logps": chosen_token_logps,
            "ref_chosen_token_logps": ref_chosen_token_logps,
        },
        {
            "rejected_token_logps": rejected_token_logps,
            "ref_rejected_token_logps": ref_rejected_token_logps,
        },
        chosen_where,
        rejected_where,
        where,
    )
    shared = jnp.minimum(jnp.sum(chosen_mask, axis=-1), jnp.sum(rejected_mask, axis=-1))
    alpha = jnp.asarray(tail_weight, chosen_arrays[0].dtype)
    chosen, ref_chosen = (_desensitized(x, chosen_mask, shared, alpha) for x in chosen_arrays)
    rejected, ref_rejected = (
        _desensitized(x, rejected_mask, shared, alpha) for x in rejected_arrays
    )
    h, _ = dpo_margin((chosen, rejected, ref_chosen, ref_rejected), where)
    loss = -jax.nn.log_sigmoid(jnp.asarray(beta, h.dtype) * h)
    return jnp.where(where, loss, 0.0)
