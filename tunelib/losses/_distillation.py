"""Knowledge distillation: token-level divergences between student and teacher logits.

Every function here takes the student's and the teacher's logits at the same positions and
returns one loss per token. The teacher is data: gradients flow into `teacher_logits` like into
any other input, so wrap them in `jax.lax.stop_gradient` when they come from a model you also
differentiate (a frozen teacher outside the differentiated function needs nothing).
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int

from tunelib import _validation as v
from tunelib._typing import Scalar

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]
_DIVERGENCES: tuple[str, ...] = Divergence.__args__

# Below this |u| the per-token term phi(u) = u - log1p(u) comes from its Taylor series, where
# the direct difference would lose digits to cancellation.
_SERIES_RADIUS = 0.1
# expm1 of larger log-ratios could overflow float32; those tokens take the log-space branch.
_EXPM1_MAX = 80.0


def _checked_logits(
    student_logits: ArrayLike, teacher_logits: ArrayLike, where: ArrayLike | None
) -> tuple[jax.Array, jax.Array, jax.Array, jnp.dtype]:
    """Checked student and teacher logits in the compute dtype, masked positions set to 0."""
    student = v.float_array(student_logits, "student_logits")
    teacher = v.float_array(teacher_logits, "teacher_logits")
    v.check_ndim(student, "student_logits", at_least=2)
    v.same_shape(student_logits=student, teacher_logits=teacher)
    where = v.mask_array(where, student.shape[:-1])
    dtype = v.compute_dtype(student.dtype, teacher.dtype)
    student = jnp.where(where[..., None], student.astype(dtype), 0.0)
    teacher = jnp.where(where[..., None], teacher.astype(dtype), 0.0)
    return student, teacher, where, dtype


def _tempered_log_probs(
    student_logits: ArrayLike,
    teacher_logits: ArrayLike,
    temperature: Scalar,
    where: ArrayLike | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`log softmax(z / tau)` of student and teacher, the mask, and `tau` in the compute dtype."""
    v.positive_scalar(temperature, "temperature")
    student, teacher, where, dtype = _checked_logits(student_logits, teacher_logits, where)
    tau = jnp.asarray(temperature, dtype)
    log_p_student = jax.nn.log_softmax(student / tau, axis=-1)
    log_p_teacher = jax.nn.log_softmax(teacher / tau, axis=-1)
    return log_p_student, log_p_teacher, where, tau


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


def _mixture_divergence(
    log_p: jax.Array, log_q: jax.Array, w: ArrayLike, w_complement: ArrayLike
) -> jax.Array:
    r"""$D_w(p, q) = \mathrm{KL}(p \,\|\, (1 - w) p + w q) / w$ summed over the last axis."""
    return jnp.sum(_mixture_divergence_terms(log_p, log_q, w, w_complement), axis=-1)


def _scale(tau: jax.Array, temperature_squared: bool) -> jax.Array:
    return tau**2 if temperature_squared else jnp.ones_like(tau)


def forward_kl_loss(
    student_logits: Float[ArrayLike, "*B T V"],
    teacher_logits: Float[ArrayLike, "*B T V"],
    *,
    temperature: Scalar = 1.0,
    temperature_squared: bool = True,
    where: Bool[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Per-token forward KL divergence from the teacher to the student (mass-covering).

    $$
    \ell_t = \tau^2 \, \mathrm{KL}(p^T_t \,\|\, p^S_t)
    = \tau^2 \sum_v p^T_{t,v} \log \frac{p^T_{t,v}}{p^S_{t,v}},
    \qquad p^S_t = \mathrm{softmax}(z^S_t / \tau), \quad p^T_t = \mathrm{softmax}(z^T_t / \tau)
    $$

    with student logits $z^S$ = `student_logits`, teacher logits $z^T$ = `teacher_logits` and
    temperature $\tau$ = `temperature`. The factor $\tau^2$ (`temperature_squared=True`,
    Hinton et al. 2015) keeps the gradient magnitude independent of $\tau$: the gradient with
    respect to $z^S$ is $\tau (p^S - p^T)$ with it and $(p^S - p^T) / \tau$ without it. TRL's
    GKD trainer divides the logits by the temperature but does not multiply by $\tau^2$;
    `temperature_squared=False` reproduces that.

    Each token's value is summed from the non-negative terms
    $p^T_v \log(p^T_v / p^S_v) - p^T_v + p^S_v$, so it is never negative through rounding and is
    exactly 0 for identical logits. Tokens with `-inf` logits in both (forbidden tokens)
    contribute 0 with a finite gradient; a token the teacher allows and the student forbids
    makes the loss infinite.

    Args:
      student_logits: `[..., T, V]` student scores, any float dtype (computed in float32).
      teacher_logits: `[..., T, V]` teacher scores. Gradients flow into them too; stop them
        with `jax.lax.stop_gradient` if the teacher must not be trained.
      temperature: $\tau > 0$, applied to both; may be traced.
      temperature_squared: multiply by $\tau^2$ (static).
      where: `[..., T]` boolean mask, True = counts. Masked positions give exactly 0 and zero
        gradient, even with `-inf`/NaN logits there.

    Returns:
      `[..., T]` per-token losses, float32 (float64 for float64 logits).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import forward_kl_loss
      >>> student = jnp.array([[[1.0, 0.0, 0.0]]])
      >>> teacher = jnp.array([[[2.0, 0.0, -1.0]]])
      >>> print(forward_kl_loss(student, teacher).round(4))
      [[0.1834]]
      >>> print(forward_kl_loss(student, teacher, temperature=2.0).round(4))
      [[0.2966]]

    References:
      Hinton et al., "Distilling the Knowledge in a Neural Network", 2015,
      https://arxiv.org/abs/1503.02531.
    """
    log_p_student, log_p_teacher, where, tau = _tempered_log_probs(
        student_logits, teacher_logits, temperature, where
    )
    kl = _mixture_divergence(log_p_teacher, log_p_student, 1.0, 0.0)
    return jnp.where(where, _scale(tau, temperature_squared) * kl, 0.0)


def reverse_kl_loss(
    student_logits: Float[ArrayLike, "*B T V"],
    teacher_logits: Float[ArrayLike, "*B T V"],
    *,
    temperature: Scalar = 1.0,
    temperature_squared: bool = True,
    where: Bool[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Per-token reverse KL divergence from the student to the teacher (mode-seeking).

    $$
    \ell_t = \tau^2 \, \mathrm{KL}(p^S_t \,\|\, p^T_t)
    = \tau^2 \sum_v p^S_{t,v} \log \frac{p^S_{t,v}}{p^T_{t,v}},
    \qquad p^S_t = \mathrm{softmax}(z^S_t / \tau), \quad p^T_t = \mathrm{softmax}(z^T_t / \tau)
    $$

    with $z^S$ = `student_logits`, $z^T$ = `teacher_logits`, $\tau$ = `temperature`. The
    student is penalised for putting mass where the teacher has little, so it concentrates on
    the teacher's major modes instead of spreading over all of them (MiniLLM, Gu et al. 2024,
    who minimise the sequence-level reverse KL with a policy gradient; this is its per-token
    term over the full vocabulary). The $\tau^2$ factor is as in `forward_kl_loss`; TRL's
    GKD trainer does not apply it (`temperature_squared=False`).

    Tokens with `-inf` logits in both contribute 0 with a finite gradient; a token the student
    allows and the teacher forbids makes the loss infinite.

    Args:
      student_logits: `[..., T, V]` student scores, any float dtype (computed in float32).
      teacher_logits: `[..., T, V]` teacher scores (gradients flow into them; see
        `forward_kl_loss`).
      temperature: $\tau > 0$; may be traced.
      temperature_squared: multiply by $\tau^2$ (static).
      where: `[..., T]` boolean mask, True = counts; masked positions give 0 and zero gradient.

    Returns:
      `[..., T]` per-token losses, float32 (float64 for float64 logits).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import reverse_kl_loss
      >>> student = jnp.array([[[1.0, 0.0, 0.0]]])
      >>> teacher = jnp.array([[[2.0, 0.0, -1.0]]])
      >>> print(reverse_kl_loss(student, teacher).round(4))
      [[0.2542]]

    References:
      Gu et al., "MiniLLM: Knowledge Distillation of Large Language Models", 2024,
      https://arxiv.org/abs/2306.08543.
    """
    log_p_student, log_p_teacher, where, tau = _tempered_log_probs(
        student_logits, teacher_logits, temperature, where
    )
    kl = _mixture_divergence(log_p_student, log_p_teacher, 1.0, 0.0)
    return jnp.where(where, _scale(tau, temperature_squared) * kl, 0.0)


def generalized_jsd_loss(
    student_logits: Float[ArrayLike, "*B T V"],
    teacher_logits: Float[ArrayLike, "*B T V"],
    *,
    beta: Scalar = 0.5,
    temperature: Scalar = 1.0,
    temperature_squared: bool = True,
    normalize: bool = True,
    where: Bool[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Per-token generalized Jensen-Shannon divergence of GKD, continuous in $\beta$.

    $$
    \mathrm{JSD}_\beta = \beta \, \mathrm{KL}(p^T \,\|\, M) + (1 - \beta)\,
    \mathrm{KL}(p^S \,\|\, M), \qquad M = \beta p^T + (1 - \beta) p^S,
    \qquad \ell_t = \tau^2 \, \frac{\mathrm{JSD}_\beta(t)}{\beta (1 - \beta)}
    $$

    with $p^S = \mathrm{softmax}(z^S / \tau)$ for $z^S$ = `student_logits`,
    $p^T = \mathrm{softmax}(z^T / \tau)$ for $z^T$ = `teacher_logits`, $\beta$ = `beta` and
    $\tau$ = `temperature` (the $\tau^2$ factor as in `forward_kl_loss`, when
    `temperature_squared`).

    $\mathrm{JSD}_\beta$ tends to 0 at both ends of $[0, 1]$, like
    $\beta\,\mathrm{KL}(p^T \| p^S)$ as $\beta \to 0$ and
    $(1 - \beta)\,\mathrm{KL}(p^S \| p^T)$ as $\beta \to 1$. With `normalize=True` (the
    default) we divide by $\beta (1 - \beta)$: the loss is then continuous on $[0, 1]$, tends
    to the forward KL as $\beta \to 0$ and to the reverse KL as $\beta \to 1$ (both at rate
    $O(\beta)$, resp. $O(1 - \beta)$), and equals `forward_kl_loss` at $\beta = 0$ and
    `reverse_kl_loss` at $\beta = 1$. With `normalize=False` the loss is the paper's
    $\tau^2 \mathrm{JSD}_\beta$ (at $\beta = 1/2$ the symmetric Jensen-Shannon divergence, at
    most $\tau^2 \log 2$), which is 0 at both ends. TRL's `generalized_jsd_loss` computes the
    unnormalised $\mathrm{JSD}_\beta$ for $0 < \beta < 1$ but switches to the forward KL at
    $\beta = 0$ and the reverse KL at $\beta = 1$, so its loss jumps at both ends; it does not
    multiply by $\tau^2$.

    The normalised value is computed as $D_{1-\beta}(p^T, p^S) + D_\beta(p^S, p^T)$ with
    $D_w(p, q) = \mathrm{KL}(p \,\|\, (1 - w) p + w q) / w$, each summed from non-negative
    per-token terms $p\,\varphi(w (q/p - 1)) / w$, $\varphi(u) = u - \log(1 + u)$, with a
    series for small arguments: accurate to float32 precision for $\beta$ down to $10^{-6}$
    and below, where dividing the plain formula by $\beta$ would amplify its rounding error a
    millionfold. Swapping student and teacher with $\beta \to 1 - \beta$ gives the same value.

    Args:
      student_logits: `[..., T, V]` student scores, any float dtype (computed in float32).
      teacher_logits: `[..., T, V]` teacher scores (gradients flow into them; see
        `forward_kl_loss`).
      beta: $\beta \in [0, 1]$, the teacher's weight in the mixture $M$; may be traced.
      temperature: $\tau > 0$; may be traced.
      temperature_squared: multiply by $\tau^2$ (static).
      normalize: divide by $\beta (1 - \beta)$ (static; see above).
      where: `[..., T]` boolean mask, True = counts; masked positions give 0 and zero gradient.

    Returns:
      `[..., T]` per-token losses, float32 (float64 for float64 logits).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import generalized_jsd_loss
      >>> student = jnp.array([[[1.0, 0.0, 0.0]]])
      >>> teacher = jnp.array([[[2.0, 0.0, -1.0]]])
      >>> print(generalized_jsd_loss(student, teacher, beta=0.5).round(4))
      [[0.2047]]
      >>> print(generalized_jsd_loss(student, teacher, beta=0.5, normalize=False).round(4))
      [[0.0512]]
      >>> print(generalized_jsd_loss(student, teacher, beta=0.0).round(4))  # forward KL
      [[0.1834]]

    References:
      Agarwal et al., "On-Policy Distillation of Language Models: Learning from
      Self-Generated Mistakes" (GKD), 2024, https://arxiv.org/abs/2306.13649.
    """
    v.unit_interval(beta, "beta")
    log_p_student, log_p_teacher, where, tau = _tempered_log_probs(
        student_logits, teacher_logits, temperature, where
    )
    beta = jnp.asarray(beta, tau.dtype)
    jsd = _mixture_divergence(log_p_teacher, log_p_student, 1 - beta, beta) + _mixture_divergence(
        log_p_student, log_p_teacher, beta, 1 - beta
    )
    if not normalize:
        jsd = beta * (1 - beta) * jsd
    return jnp.where(where, _scale(tau, temperature_squared) * jsd, 0.0)


def teacher_top_k(
    teacher_logits: Float[ArrayLike, "*B T V"], *, k: int
) -> tuple[Float[Array, "*B T K"], Int[Array, "*B T K"]]:
    """The teacher's `k` largest logits at each position and their token ids.

    Keeping only these is how offline distillation data is usually stored (`k` logits and ids
    per token instead of `V`); `top_k_forward_kl_loss` consumes them.

    Args:
      teacher_logits: `[..., T, V]` teacher scores.
      k: how many to keep, `1 <= k <= V` (static).

    Returns:
      `(top_logits, top_ids)`: `[..., T, k]` logits in the input dtype, in descending order
      (ties broken towards the lower id), and their `int32` ids.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import teacher_top_k
      >>> top_logits, top_ids = teacher_top_k(jnp.array([[[0.5, 3.0, -1.0, 2.0]]]), k=2)
      >>> print(top_logits, top_ids)
      [[[3. 2.]]] [[[1 3]]]
    """
    teacher = v.float_array(teacher_logits, "teacher_logits")
    v.check_ndim(teacher, "teacher_logits", at_least=2)
    if not isinstance(k, int) or not 1 <= k <= teacher.shape[-1]:
        raise ValueError(f"k must be an integer in [1, V = {teacher.shape[-1]}], got {k!r}.")
    top_logits, top_ids = jax.lax.top_k(teacher, k)
    return top_logits, top_ids


def top_k_forward_kl_loss(
    student_logits: Float[ArrayLike, "*B T V"],
    teacher_top_logits: Float[ArrayLike, "*B T K"],
    teacher_top_ids: Int[ArrayLike, "*B T K"],
    *,
    temperature: Scalar = 1.0,
    temperature_squared: bool = True,
    where: Bool[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Per-token forward KL from a teacher kept only on its top-$k$ tokens to the student.

    $$
    \ell_t = \tau^2 \sum_{j=1}^{k} \tilde p^T_{t,j}
    \left( \log \tilde p^T_{t,j} - \log p^S_{t, i_{t,j}} \right),
    \qquad \tilde p^T_t = \mathrm{softmax}_j(\tilde z^T_{t,j} / \tau), \quad
    p^S_t = \mathrm{softmax}(z^S_t / \tau)
    $$

    with $\tilde z^T$ = `teacher_top_logits` (softmax over the $k$ kept entries only: the
    teacher renormalised on its top $k$), ids $i$ = `teacher_top_ids`, $z^S$ =
    `student_logits` (normalised over the full vocabulary) and $\tau$ = `temperature`. This
    equals $\mathrm{KL}(\tilde p^T \,\|\, \hat p^S) - \log \sum_j p^S_{i_j} \ge 0$ with
    $\hat p^S$ the student renormalised on the same ids, so it also pushes the student's
    mass onto the teacher's top $k$. With $k = V$ it is `forward_kl_loss`. The $\tau^2$
    factor is as there.

    Args:
      student_logits: `[..., T, V]` student scores, any float dtype (computed in float32).
      teacher_top_logits: `[..., T, k]` the teacher's kept logits, e.g. from `teacher_top_k`.
      teacher_top_ids: `[..., T, k]` their token ids in `[0, V)`; an id outside that range
        makes its token's loss NaN.
      temperature: $\tau > 0$; may be traced.
      temperature_squared: multiply by $\tau^2$ (static).
      where: `[..., T]` boolean mask, True = counts; masked positions give 0 and zero gradient,
        whatever their logits and ids.

    Returns:
      `[..., T]` per-token losses, float32 (float64 for float64 logits).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import teacher_top_k, top_k_forward_kl_loss
      >>> student = jnp.array([[[1.0, 0.0, 0.0, 0.5]]])
      >>> top_logits, top_ids = teacher_top_k(jnp.array([[[2.0, 0.0, -1.0, 1.0]]]), k=2)
      >>> print(top_k_forward_kl_loss(student, top_logits, top_ids).round(4))
      [[0.4034]]

    References:
      Hinton et al., "Distilling the Knowledge in a Neural Network", 2015,
      https://arxiv.org/abs/1503.02531.
    """
    student = v.float_array(student_logits, "student_logits")
    top_logits = v.float_array(teacher_top_logits, "teacher_top_logits")
    top_ids = v.int_array(teacher_top_ids, "teacher_top_ids")
    v.check_ndim(student, "student_logits", at_least=2)
    v.check_ndim(top_logits, "teacher_top_logits", at_least=1)
    k = top_logits.shape[-1]
    v.check_shape(
        top_logits,
        "teacher_top_logits",
        (*student.shape[:-1], k),
        f"student_logits {student.shape} with k = {k} kept entries",
    )
    if k > student.shape[-1]:
        raise ValueError(
            f"teacher_top_logits keeps k = {k} entries, more than the V = {student.shape[-1]} "
            f"of student_logits {student.shape}."
        )
    v.check_shape(top_ids, "teacher_top_ids", top_logits.shape, "teacher_top_logits")
    v.positive_scalar(temperature, "temperature")
    where = v.mask_array(where, student.shape[:-1])
    dtype = v.compute_dtype(student.dtype, top_logits.dtype)
    tau = jnp.asarray(temperature, dtype)
    student = jnp.where(where[..., None], student.astype(dtype), 0.0)
    top_logits = jnp.where(where[..., None], top_logits.astype(dtype), 0.0)
    top_ids = jnp.where(where[..., None], top_ids, 0)
    log_p_student = jax.nn.log_softmax(student / tau, axis=-1)
    log_q = jnp.take_along_axis(log_p_student, top_ids, axis=-1, wrap_negative_indices=False)
    log_p = jax.nn.log_softmax(top_logits / tau, axis=-1)
    p = jnp.exp(log_p)
    kept = p > 0
    terms = p * (jnp.where(kept, log_p, 0.0) - jnp.where(kept, log_q, 0.0))
    kl = jnp.sum(jnp.where(kept, terms, 0.0), axis=-1)
    return jnp.where(where, _scale(tau, temperature_squared) * kl, 0.0)


def _cross_entropy(log_p: jax.Array, targets: jax.Array, where: jax.Array) -> jax.Array:
    safe_targets = jnp.where(where, targets, 0)
    return -jnp.take_along_axis(log_p, safe_targets[..., None], axis=-1)[..., 0]


def teacher_argmax_loss(
    student_logits: Float[ArrayLike, "*B T V"],
    teacher_logits: Float[ArrayLike, "*B T V"],
    *,
    where: Bool[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Per-token cross-entropy of the student on the teacher's most likely token (hard labels).

    $$
    \ell_t = -\log p^S_{t, y_t}, \qquad y_t = \arg\max_v z^T_{t,v},
    \quad p^S_t = \mathrm{softmax}(z^S_t)
    $$

    with $z^S$ = `student_logits` and $z^T$ = `teacher_logits`, at temperature 1 (ties go to
    the lowest id). This is sequence-level distillation's token loss when the teacher's
    greedy token is the label; no gradient reaches the teacher.

    Args:
      student_logits: `[..., T, V]` student scores, any float dtype (computed in float32).
      teacher_logits: `[..., T, V]` teacher scores.
      where: `[..., T]` boolean mask, True = counts; masked positions give 0 and zero gradient.

    Returns:
      `[..., T]` per-token losses, float32 (float64 for float64 logits).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import teacher_argmax_loss
      >>> student = jnp.array([[[1.0, 0.0, 0.0]]])
      >>> teacher = jnp.array([[[0.0, 2.0, -1.0]]])
      >>> print(teacher_argmax_loss(student, teacher).round(4))  # -log softmax(student)[1]
      [[1.5514]]

    References:
      Kim and Rush, "Sequence-Level Knowledge Distillation", 2016,
      https://arxiv.org/abs/1606.07947.
    """
    student, teacher, where, _ = _checked_logits(student_logits, teacher_logits, where)
    targets = jnp.argmax(teacher, axis=-1)
    loss = _cross_entropy(jax.nn.log_softmax(student, axis=-1), targets, where)
    return jnp.where(where, loss, 0.0)


def soft_hard_distillation_loss(
    student_logits: Float[ArrayLike, "*B T V"],
    teacher_logits: Float[ArrayLike, "*B T V"],
    *,
    alpha: Scalar = 0.5,
    temperature: Scalar = 2.0,
    divergence: Divergence = "forward_kl",
    beta: Scalar = 0.5,
    labels: Int[ArrayLike, "*B T"] | None = None,
    where: Bool[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Per-token mix of a soft (teacher distribution) and a hard (label) distillation loss.

    $$
    \ell_t = \alpha \, \tau^2 \, D\big(p^S_t(\tau), p^T_t(\tau)\big)
    + (1 - \alpha) \big(-\log p^S_{t, y_t}(1)\big)
    $$

    with $p(\tau) = \mathrm{softmax}(z / \tau)$, $\alpha$ = `alpha`, $\tau$ = `temperature`,
    $D$ the divergence named by `divergence` (``"forward_kl"``:
    $\mathrm{KL}(p^T \| p^S)$ as in Hinton et al. 2015; ``"reverse_kl"``:
    $\mathrm{KL}(p^S \| p^T)$; ``"jsd"``: the normalised generalized JSD of
    `generalized_jsd_loss` with $\beta$ = `beta`), always with the $\tau^2$ factor, and the
    hard term the student's cross-entropy at temperature 1 on $y$ = `labels` (the ground
    truth, as in Hinton et al.) or, when `labels` is None, on the teacher's argmax token
    (`teacher_argmax_loss`).

    Hinton et al. use the cross-entropy $H(p^T, p^S)$ as the soft term; it differs from the
    forward KL used here by the teacher's entropy, which does not depend on the student, so
    the student's gradients are the same and the soft term is 0 at a perfect match.

    Args:
      student_logits: `[..., T, V]` student scores, any float dtype (computed in float32).
      teacher_logits: `[..., T, V]` teacher scores (gradients flow into them; see
        `forward_kl_loss`).
      alpha: $\alpha \in [0, 1]$, the soft term's weight; may be traced.
      temperature: $\tau > 0$ of the soft term; may be traced.
      divergence: ``"forward_kl"`` (default), ``"reverse_kl"`` or ``"jsd"`` (static).
      beta: $\beta \in [0, 1]$ of ``"jsd"``, ignored otherwise; may be traced.
      labels: `[..., T]` integer ground-truth token ids, or None to use the teacher's argmax.
        Masked positions may hold any value (e.g. -100).
      where: `[..., T]` boolean mask, True = counts; masked positions give 0 and zero gradient.

    Returns:
      `[..., T]` per-token losses, float32 (float64 for float64 logits).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import soft_hard_distillation_loss
      >>> student = jnp.array([[[1.0, 0.0, 0.0]]])
      >>> teacher = jnp.array([[[2.0, 0.0, -1.0]]])
      >>> print(soft_hard_distillation_loss(student, teacher).round(4))
      [[0.424]]
      >>> labels = jnp.array([[2]])
      >>> print(soft_hard_distillation_loss(student, teacher, alpha=0.9, labels=labels).round(4))
      [[0.4221]]

    References:
      Hinton et al., "Distilling the Knowledge in a Neural Network", 2015,
      https://arxiv.org/abs/1503.02531.
    """
    if divergence not in _DIVERGENCES:
        raise ValueError(f"divergence must be one of {_DIVERGENCES}, got {divergence!r}.")
    v.unit_interval(alpha, "alpha")
    if divergence == "forward_kl":
        soft = forward_kl_loss(student_logits, teacher_logits, temperature=temperature, where=where)
    elif divergence == "reverse_kl":
        soft = reverse_kl_loss(student_logits, teacher_logits, temperature=temperature, where=where)
    else:
        soft = generalized_jsd_loss(
            student_logits, teacher_logits, beta=beta, temperature=temperature, where=where
        )
    if labels is None:
        hard = teacher_argmax_loss(student_logits, teacher_logits, where=where)
    else:
        student, _, where, _ = _checked_logits(student_logits, teacher_logits, where)
        labels = v.int_array(labels, "labels")
        v.check_shape(labels, "labels", student.shape[:-1], f"student_logits {student.shape}")
        hard = _cross_entropy(jax.nn.log_softmax(student, axis=-1), labels, where)
        hard = jnp.where(where, hard, 0.0)
    alpha = jnp.asarray(alpha, soft.dtype)
    return alpha * soft + (1 - alpha) * hard
