"""Knowledge distillation: token-level losses between student and teacher logits.

Every function here takes the student's and the teacher's logits at the same positions and
returns one loss per token. The divergences themselves are `tunelib.logprobs.token_divergence`
(and, from hidden states without logits, `tunelib.logprobs.fused_divergence`); the losses add
Hinton et al.'s $\tau^2$ factor, sparse teachers, hard labels and their mix. The teacher is
data: gradients flow into `teacher_logits` like into any other input, so wrap them in
`jax.lax.stop_gradient` when they come from a model you also differentiate (a frozen teacher
outside the differentiated function needs nothing).
"""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from tunelib import _deprecation, logprobs
from tunelib import _validation as v
from tunelib._typing import Mask, Scalar


def _scaled(value: jax.Array, temperature: Scalar, temperature_squared: bool) -> jax.Array:
    """`value * temperature**2` (Hinton et al.'s factor) when `temperature_squared`."""
    if not temperature_squared:
        return value
    return value * jnp.asarray(temperature, value.dtype) ** 2


def forward_kl_loss(
    student_logits: Float[ArrayLike, "*B T V"],
    teacher_logits: Float[ArrayLike, "*B T V"],
    *,
    temperature: Scalar = 1.0,
    temperature_squared: bool = True,
    where: Mask[ArrayLike, "*B T"] | None = None,
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
      where: `[..., T]` mask, True (or 1) = counts. Masked positions give exactly 0 and zero
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
    kl = logprobs.token_divergence(
        student_logits,
        teacher_logits,
        divergence="forward_kl",
        temperature=temperature,
        where=where,
    )
    return _scaled(kl, temperature, temperature_squared)


def reverse_kl_loss(
    student_logits: Float[ArrayLike, "*B T V"],
    teacher_logits: Float[ArrayLike, "*B T V"],
    *,
    temperature: Scalar = 1.0,
    temperature_squared: bool = True,
    where: Mask[ArrayLike, "*B T"] | None = None,
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
      where: `[..., T]` mask, True (or 1) = counts; masked positions give 0 and zero gradient.

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
    kl = logprobs.token_divergence(
        student_logits,
        teacher_logits,
        divergence="reverse_kl",
        temperature=temperature,
        where=where,
    )
    return _scaled(kl, temperature, temperature_squared)


@_deprecation.renamed_arguments(beta="mix")
def generalized_jsd_loss(
    student_logits: Float[ArrayLike, "*B T V"],
    teacher_logits: Float[ArrayLike, "*B T V"],
    *,
    mix: Scalar = 0.5,
    temperature: Scalar = 1.0,
    temperature_squared: bool = True,
    normalize: bool = True,
    where: Mask[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Per-token generalized Jensen-Shannon divergence of GKD, continuous in $\beta$.

    $$
    \mathrm{JSD}_\beta = \beta \, \mathrm{KL}(p^T \,\|\, M) + (1 - \beta)\,
    \mathrm{KL}(p^S \,\|\, M), \qquad M = \beta p^T + (1 - \beta) p^S,
    \qquad \ell_t = \tau^2 \, \frac{\mathrm{JSD}_\beta(t)}{\beta (1 - \beta)}
    $$

    with $p^S = \mathrm{softmax}(z^S / \tau)$ for $z^S$ = `student_logits`,
    $p^T = \mathrm{softmax}(z^T / \tau)$ for $z^T$ = `teacher_logits`, $\beta$ = `mix` and
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

    The value is $\tau^2$ times `tunelib.logprobs.token_divergence` with ``divergence="jsd"``,
    whose numerics keep it accurate to float32 precision for $\beta$ down to $10^{-6}$ and
    below. Swapping student and teacher with $\beta \to 1 - \beta$ gives the same value. The
    mixture weight was called `beta`, GKD's symbol, which tunelib keeps for the strength of
    the DPO family; the old name still works until tunelib 0.3.0, with a `DeprecationWarning`.

    Args:
      student_logits: `[..., T, V]` student scores, any float dtype (computed in float32).
      teacher_logits: `[..., T, V]` teacher scores (gradients flow into them; see
        `forward_kl_loss`).
      mix: $\beta \in [0, 1]$, the teacher's weight in the mixture $M$; may be traced.
      temperature: $\tau > 0$; may be traced.
      temperature_squared: multiply by $\tau^2$ (static).
      normalize: divide by $\beta (1 - \beta)$ (static; see above).
      where: `[..., T]` mask, True (or 1) = counts; masked positions give 0 and zero gradient.

    Returns:
      `[..., T]` per-token losses, float32 (float64 for float64 logits).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import generalized_jsd_loss
      >>> student = jnp.array([[[1.0, 0.0, 0.0]]])
      >>> teacher = jnp.array([[[2.0, 0.0, -1.0]]])
      >>> print(generalized_jsd_loss(student, teacher, mix=0.5).round(4))
      [[0.2047]]
      >>> print(generalized_jsd_loss(student, teacher, mix=0.5, normalize=False).round(4))
      [[0.0512]]
      >>> print(generalized_jsd_loss(student, teacher, mix=0.0).round(4))  # forward KL
      [[0.1834]]

    References:
      Agarwal et al., "On-Policy Distillation of Language Models: Learning from
      Self-Generated Mistakes" (GKD), 2024, https://arxiv.org/abs/2306.13649.
    """
    jsd = logprobs.token_divergence(
        student_logits,
        teacher_logits,
        divergence="jsd",
        mix=mix,
        normalize=normalize,
        temperature=temperature,
        where=where,
    )
    return _scaled(jsd, temperature, temperature_squared)


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
    where: Mask[ArrayLike, "*B T"] | None = None,
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
      teacher_top_ids: `[..., T, k]` their token ids in `[0, V)`. An id outside that range at a
        counted position is a `ValueError` when the ids can be read (outside `jax.jit`); under
        `jit` it makes its token's loss NaN.
      temperature: $\tau > 0$; may be traced.
      temperature_squared: multiply by $\tau^2$ (static).
      where: `[..., T]` mask, True (or 1) = counts; masked positions give 0 and zero gradient,
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
    top_ids, inside = v.token_id_array(
        top_ids, student.shape[-1], where[..., None], "teacher_top_ids"
    )
    log_p_student = jax.nn.log_softmax(student / tau, axis=-1)
    log_q = jnp.take_along_axis(log_p_student, top_ids, axis=-1)
    log_q = jnp.where(inside, log_q, jnp.nan)
    log_p = jax.nn.log_softmax(top_logits / tau, axis=-1)
    p = jnp.exp(log_p)
    kept = p > 0
    terms = p * (jnp.where(kept, log_p, 0.0) - jnp.where(kept, log_q, 0.0))
    kl = jnp.sum(jnp.where(kept, terms, 0.0), axis=-1)
    return _scaled(jnp.where(where, kl, 0.0), temperature, temperature_squared)


def teacher_argmax_loss(
    student_logits: Float[ArrayLike, "*B T V"],
    teacher_logits: Float[ArrayLike, "*B T V"],
    *,
    where: Mask[ArrayLike, "*B T"] | None = None,
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
      where: `[..., T]` mask, True (or 1) = counts; masked positions give 0 and zero gradient.

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
    student = v.float_array(student_logits, "student_logits")
    teacher = v.float_array(teacher_logits, "teacher_logits")
    v.check_ndim(student, "student_logits", at_least=2)
    v.same_shape(student_logits=student, teacher_logits=teacher)
    where = v.mask_array(where, student.shape[:-1])
    logps = logprobs.token_logps(student, jnp.argmax(teacher, axis=-1), where=where)
    return jnp.where(where, -logps, 0.0)


@_deprecation.renamed_arguments(alpha="soft_weight", beta="mix", labels="targets")
def soft_hard_distillation_loss(
    student_logits: Float[ArrayLike, "*B T V"],
    teacher_logits: Float[ArrayLike, "*B T V"],
    *,
    soft_weight: Scalar = 0.5,
    temperature: Scalar = 2.0,
    divergence: str = "forward_kl",
    mix: Scalar = 0.5,
    targets: Int[ArrayLike, "*B T"] | None = None,
    where: Mask[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Per-token mix of a soft (teacher distribution) and a hard (label) distillation loss.

    $$
    \ell_t = \alpha \, \tau^2 \, D\big(p^S_t(\tau), p^T_t(\tau)\big)
    + (1 - \alpha) \big(-\log p^S_{t, y_t}(1)\big)
    $$

    with $p(\tau) = \mathrm{softmax}(z / \tau)$, $\alpha$ = `soft_weight`, $\tau$ = `temperature`,
    $D$ the divergence named by `divergence` (``"forward_kl"``:
    $\mathrm{KL}(p^T \| p^S)$ as in Hinton et al. 2015; ``"reverse_kl"``:
    $\mathrm{KL}(p^S \| p^T)$; ``"jsd"``: the normalised generalized JSD of
    `generalized_jsd_loss` with $\beta$ = `mix`), always with the $\tau^2$ factor, and the
    hard term the student's cross-entropy at temperature 1 on $y$ = `targets` (the ground
    truth, as in Hinton et al.) or, when `targets` is None, on the teacher's argmax token
    (`teacher_argmax_loss`).

    Hinton et al. use the cross-entropy $H(p^T, p^S)$ as the soft term; it differs from the
    forward KL used here by the teacher's entropy, which does not depend on the student, so
    the student's gradients are the same and the soft term is 0 at a perfect match.

    The arguments were `alpha` (now `soft_weight`), `beta` (now `mix`) and `labels` (now
    `targets`); the old names still work until tunelib 0.3.0, with a `DeprecationWarning`.

    Args:
      student_logits: `[..., T, V]` student scores, any float dtype (computed in float32).
      teacher_logits: `[..., T, V]` teacher scores (gradients flow into them; see
        `forward_kl_loss`).
      soft_weight: $\alpha \in [0, 1]$, the soft term's weight; may be traced.
      temperature: $\tau > 0$ of the soft term; may be traced.
      divergence: ``"forward_kl"`` (default), ``"reverse_kl"`` or ``"jsd"`` (static).
      mix: $\beta \in [0, 1]$ of ``"jsd"``, ignored otherwise; may be traced.
      targets: `[..., T]` integer ground-truth token ids in `[0, V)`, or None to use the
        teacher's argmax. Masked positions may hold any value (e.g. -100); see
        `tunelib.logprobs.token_logps` for ids out of range.
      where: `[..., T]` mask, True (or 1) = counts; masked positions give 0 and zero gradient.

    Returns:
      `[..., T]` per-token losses, float32 (float64 for float64 logits).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import soft_hard_distillation_loss
      >>> student = jnp.array([[[1.0, 0.0, 0.0]]])
      >>> teacher = jnp.array([[[2.0, 0.0, -1.0]]])
      >>> print(soft_hard_distillation_loss(student, teacher).round(4))
      [[0.424]]
      >>> targets = jnp.array([[2]])
      >>> loss = soft_hard_distillation_loss(student, teacher, soft_weight=0.9, targets=targets)
      >>> print(loss.round(4))
      [[0.4221]]

    References:
      Hinton et al., "Distilling the Knowledge in a Neural Network", 2015,
      https://arxiv.org/abs/1503.02531.
    """
    v.one_of(divergence, "divergence", logprobs.DIVERGENCES)
    v.unit_interval(soft_weight, "soft_weight")
    soft = logprobs.token_divergence(
        student_logits,
        teacher_logits,
        divergence=divergence,
        mix=mix,
        temperature=temperature,
        where=where,
    )
    soft = _scaled(soft, temperature, True)
    if targets is None:
        hard = teacher_argmax_loss(student_logits, teacher_logits, where=where)
    else:
        hard = -logprobs.token_logps(student_logits, targets, where=where)
    weight = jnp.asarray(soft_weight, soft.dtype)
    return weight * soft + (1 - weight) * hard
