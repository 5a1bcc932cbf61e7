r"""Divergences between two next-token distributions, per token, over the vocabulary axis.

`token_divergence` takes the student's and the teacher's logits; `fused_divergence` takes their
hidden states and unembeddings and never forms the logits. Both sum the same non-negative
per-entry terms (`divergence_terms`), so they agree to rounding.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]
DIVERGENCES: tuple[str, ...] = Divergence.__args__

# Below this |u| the per-token term phi(u) = u - log1p(u) comes from its Taylor series, where
# the direct difference would lose digits to cancellation.
_SERIES_RADIUS = 0.1


# expm1 of larger log-ratios could overflow float32; those tokens take the log-space branch.
_EXPM1_MAX = 80.0


def _phi_over_u_squared(u: jax.Array) -> jax.Array:
    r"""$(u - \log(1 + u)) / u^2 = \sum_{k \ge 2} (-u)^{k-2} / k$, to working precision for
    $|u| \le 0.1$ (8 terms in float32, 17 in float64)."""
    n_terms = 17 if u.dtype == jnp.float64 else 8
    acc = jnp.zeros_like(u)
    for k in range(n_terms + 1, 1, -1):
        acc = 1.0 / k - u * acc
    return acc


def _mixture_divergence_terms(
    log_p: jax.Array, log_q: jax.Array, w: ArrayLike, w_complement: ArrayLike
) -> jax.Array:
    r"""The per-entry terms of $D_w(p, q) = \mathrm{KL}(p \,\|\, (1 - w) p + w q) / w$.

    They sum to $D_w$ over the last axis (see `_mixture_divergence`); kept separate so that a
    vocabulary can be summed tile by tile.

    `w_complement` is $1 - w$, passed separately because it is known exactly where $w$ is
    not (in float32, $1 - (1 - \beta)$ is off by 1 % for $\beta = 10^{-6}$). For
    $w \in (0, 1]$ and per entry $r = q / p - 1$, $u = w r$:
    $p \log(p / ((1 - w) p + w q)) / w = p\,\varphi(u)/w - p r$ with
    $\varphi(u) = u - \log(1 + u) \ge 0$, and the $-p r = p - q$ parts sum to the mass of $q$
    outside the support of $p$. So each entry contributes the non-negative
    $p\,\varphi(u) / w$ where $p > 0$ and $q$ where $p = 0$. $\varphi$ comes from its series
    for small $|u|$ (this is what keeps $D_w$ accurate as $w \to 0$, where the plain formula
    divides a cancellation error by $w$), otherwise from $(q - p) - p \log((1 - w) + w e^d)/w$
    with $d = \log q - \log p$ in log space. $D_0 = 0$: the $w \to 0$ limit whenever $q$ lives
    on the support of $p$ (otherwise the companion term of the JSD is infinite anyway). Every
    branch sees safe inputs so that no discarded branch puts NaN into a gradient.
    """
    w = jnp.asarray(w, log_p.dtype)
    w_complement = jnp.asarray(w_complement, log_p.dtype)
    p, q = jnp.exp(log_p), jnp.exp(log_q)
    p_zero = p == 0
    q_zero = jnp.isneginf(log_q)
    d = jnp.where(p_zero | q_zero, 0.0, log_q - log_p)
    big = d > _EXPM1_MAX
    r = jnp.where(q_zero, -1.0, jnp.expm1(jnp.where(big, 0.0, d)))
    u = w * r
    small = (w == 0) | (~big & (jnp.abs(u) < _SERIES_RADIUS))
    u_small = jnp.where(small, u, 0.0)
    series = p * jnp.where(small, r, 0.0) * u_small * _phi_over_u_squared(u_small)
    direct = ~p_zero & ~small
    w_direct = jnp.where(w > 0, w, 1.0)
    log_w_complement = jnp.log(jnp.where(w > 0, w_complement, 0.0))
    log_mixture_ratio = jnp.where(
        direct & q_zero,
        log_w_complement,
        jnp.logaddexp(log_w_complement, jnp.log(w_direct) + jnp.where(direct, d, 0.0)),
    )
    direct_value = (q - p) - p * log_mixture_ratio / w_direct
    return jnp.where(p_zero, jnp.where(w > 0, q, 0.0), jnp.where(small, series, direct_value))


def divergence_terms(
    log_p_student: jax.Array, log_p_teacher: jax.Array, divergence: str, mix: jax.Array
) -> jax.Array:
    """The per-entry terms whose sum over the vocabulary is the divergence (JSD normalised).

    Kept separate from the sum so that a vocabulary can be summed tile by tile.
    """
    if divergence == "forward_kl":
        return _mixture_divergence_terms(log_p_teacher, log_p_student, 1.0, 0.0)
    if divergence == "reverse_kl":
        return _mixture_divergence_terms(log_p_student, log_p_teacher, 1.0, 0.0)
    return _mixture_divergence_terms(
        log_p_teacher, log_p_student, 1 - mix, mix
    ) + _mixture_divergence_terms(log_p_student, log_p_teacher, mix, 1 - mix)


def token_divergence(
    student_logits: Float[ArrayLike, "*B T V"],
    teacher_logits: Float[ArrayLike, "*B T V"],
    *,
    divergence: Divergence = "forward_kl",
    mix: Scalar = 0.5,
    normalize: bool = True,
    temperature: Scalar = 1.0,
    where: Mask[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Per-token divergence between the teacher's and the student's tempered distributions.

    $$
    \mathrm{KL}(p^T_t \,\|\, p^S_t), \qquad \mathrm{KL}(p^S_t \,\|\, p^T_t), \qquad
    \frac{\mathrm{JSD}_\beta(t)}{\beta (1 - \beta)}, \qquad
    \mathrm{JSD}_\beta = \beta \, \mathrm{KL}(p^T \,\|\, M) + (1 - \beta)\,
    \mathrm{KL}(p^S \,\|\, M), \quad M = \beta p^T + (1 - \beta) p^S
    $$

    for `divergence` ``"forward_kl"``, ``"reverse_kl"`` and ``"jsd"``, with
    $p^S_t = \mathrm{softmax}(z^S_t / \tau)$ for $z^S$ = `student_logits`,
    $p^T_t = \mathrm{softmax}(z^T_t / \tau)$ for $z^T$ = `teacher_logits`, $\tau$ =
    `temperature` and $\beta$ = `mix`, the teacher's weight in the mixture $M$ (GKD's
    $\beta$). The distillation losses of `tunelib.losses` are these values times $\tau^2$.

    $\mathrm{JSD}_\beta$ tends to 0 at both ends of $[0, 1]$. With `normalize=True` (the
    default) it is divided by $\beta (1 - \beta)$: the value is then continuous on $[0, 1]$,
    tends to the forward KL as $\beta \to 0$ and to the reverse KL as $\beta \to 1$, and equals
    them at $\beta = 0$ and $\beta = 1$. With `normalize=False` it is the GKD paper's
    $\mathrm{JSD}_\beta$ (at $\beta = 1/2$ the symmetric Jensen-Shannon divergence, at most
    $\log 2$). Swapping student and teacher with $\beta \to 1 - \beta$ gives the same value.

    Each token's value is summed from non-negative per-entry terms, so it is never negative
    through rounding and is exactly 0 for identical logits: for the KLs
    $p_v \log(p_v / q_v) - p_v + q_v$; for the JSD $D_{1-\beta}(p^T, p^S) + D_\beta(p^S, p^T)$
    with $D_w(p, q) = \mathrm{KL}(p \,\|\, (1 - w) p + w q) / w$, each entry
    $p\,\varphi(w (q/p - 1)) / w$, $\varphi(u) = u - \log(1 + u)$ from a series for small
    arguments: accurate to float32 precision for $\beta$ down to $10^{-6}$ and below, where
    dividing the plain formula by $\beta$ would amplify its rounding error a millionfold.
    Vocabulary entries with `-inf` logits in both (forbidden tokens) contribute 0 with a finite
    gradient; an entry one distribution allows and the other forbids makes a KL infinite.

    Args:
      student_logits: `[..., T, V]` student scores, any float dtype (computed in float32).
      teacher_logits: `[..., T, V]` teacher scores. Gradients flow into them like into any
        input: stop them with `jax.lax.stop_gradient` if the teacher must not be trained.
      divergence: ``"forward_kl"`` (default), ``"reverse_kl"`` or ``"jsd"`` (static).
      mix: $\beta \in [0, 1]$ of ``"jsd"``, ignored otherwise; may be traced.
      normalize: for ``"jsd"``, divide by $\beta (1 - \beta)$ (static); ignored otherwise.
      temperature: $\tau > 0$, applied to both; may be traced.
      where: `[..., T]` mask, True (or 1) = counts. Masked positions give exactly 0 and zero
        gradient, even with `-inf`/NaN logits there.

    Returns:
      `[..., T]` per-token divergences in nats, float32 (float64 for float64 logits).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.logprobs import token_divergence
      >>> student = jnp.array([[[1.0, 0.0, 0.0]]])
      >>> teacher = jnp.array([[[2.0, 0.0, -1.0]]])
      >>> for divergence in ("forward_kl", "reverse_kl", "jsd"):
      ...     print(divergence, token_divergence(student, teacher, divergence=divergence).round(4))
      forward_kl [[0.1834]]
      reverse_kl [[0.2542]]
      jsd [[0.2047]]
      >>> print(token_divergence(student, teacher, divergence="jsd", normalize=False).round(4))
      [[0.0512]]

    References:
      Hinton et al., "Distilling the Knowledge in a Neural Network", 2015,
      https://arxiv.org/abs/1503.02531.
      Gu et al., "MiniLLM: Knowledge Distillation of Large Language Models", 2024,
      https://arxiv.org/abs/2306.08543.
      Agarwal et al., "On-Policy Distillation of Language Models: Learning from
      Self-Generated Mistakes" (GKD), 2024, https://arxiv.org/abs/2306.13649.
    """
    v.one_of(divergence, "divergence", DIVERGENCES)
    if divergence == "jsd":
        v.unit_interval(mix, "mix")
    v.positive_scalar(temperature, "temperature")
    student = v.float_array(student_logits, "student_logits")
    teacher = v.float_array(teacher_logits, "teacher_logits")
    v.check_ndim(student, "student_logits", at_least=2)
    v.same_shape(student_logits=student, teacher_logits=teacher)
    where = v.mask_array(where, student.shape[:-1])
    dtype = v.compute_dtype(student.dtype, teacher.dtype)
    tau = jnp.asarray(temperature, dtype)
    student = jnp.where(where[..., None], student.astype(dtype), 0.0)
    teacher = jnp.where(where[..., None], teacher.astype(dtype), 0.0)
    log_p_student = jax.nn.log_softmax(student / tau, axis=-1)
    log_p_teacher = jax.nn.log_softmax(teacher / tau, axis=-1)
    mix = jnp.asarray(mix, dtype)
    value = jnp.sum(divergence_terms(log_p_student, log_p_teacher, divergence, mix), axis=-1)
    if divergence == "jsd" and not normalize:
        value = mix * (1 - mix) * value
    return jnp.where(where, value, 0.0)
