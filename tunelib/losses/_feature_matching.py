"""Knowledge distillation on intermediate features: hidden states and attention outputs.

The student's features are mapped onto the teacher's feature space by a learned linear
projection (an array the user keeps in their parameter pytree and trains with the student),
then compared token by token.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._typing import Mask

Metric = Literal["cosine", "mse"]
_METRICS: tuple[str, ...] = Metric.__args__

# Each norm in the cosine is clamped below at this value, so a zero vector has cosine 0 with
# anything (loss 1) and a finite gradient instead of NaN.
_COSINE_EPSILON = 1e-8


def _checked_projection(
    projection: ArrayLike | None, student: jax.Array, teacher: jax.Array, names: tuple[str, str]
) -> jax.Array | None:
    """The projection `[Ds, Dt]`, checked; required when the feature sizes differ."""
    ds, dt = student.shape[-1], teacher.shape[-1]
    student_name, teacher_name = names
    if projection is None:
        if ds != dt:
            raise ValueError(
                f"{student_name} {student.shape} has feature size {ds} but {teacher_name} "
                f"{teacher.shape} has {dt}; pass a projection of shape ({ds}, {dt})."
            )
        return None
    projection = v.float_array(projection, "projection")
    v.check_shape(
        projection, "projection", (ds, dt), f"[Ds, Dt] of {student_name} and {teacher_name}"
    )
    return projection


def _check_metric(metric: str) -> None:
    if metric not in _METRICS:
        raise ValueError(f"metric must be one of {_METRICS}, got {metric!r}.")


def _vector_loss(
    student: jax.Array,
    teacher: jax.Array,
    projection: jax.Array | None,
    metric: str,
    where: jax.Array,
) -> jax.Array:
    """Per-vector loss over the last axis; `where` broadcasts against the leading axes."""
    dtype = v.compute_dtype(
        student.dtype, teacher.dtype, *(() if projection is None else (projection.dtype,))
    )
    student = jnp.where(where[..., None], student.astype(dtype), 0.0)
    teacher = jnp.where(where[..., None], teacher.astype(dtype), 0.0)
    if projection is not None:
        student = jnp.einsum("...s,st->...t", student, projection.astype(dtype))
    if metric == "mse":
        return jnp.mean((student - teacher) ** 2, axis=-1)
    eps_squared = jnp.asarray(_COSINE_EPSILON, dtype) ** 2
    student_norm = jnp.sqrt(jnp.maximum(jnp.sum(student**2, axis=-1), eps_squared))
    teacher_norm = jnp.sqrt(jnp.maximum(jnp.sum(teacher**2, axis=-1), eps_squared))
    return 1 - jnp.sum(student * teacher, axis=-1) / (student_norm * teacher_norm)


def feature_matching_loss(
    student_features: Float[ArrayLike, "*B T Ds"],
    teacher_features: Float[ArrayLike, "*B T Dt"],
    *,
    projection: Float[ArrayLike, "Ds Dt"] | None = None,
    metric: Metric = "cosine",
    where: Mask[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Per-token distance between projected student features and teacher features.

    $$
    \ell_t^{\cos} = 1 - \frac{\langle W^\top s_t, h_t \rangle}
    {\max(\|W^\top s_t\|, \epsilon)\, \max(\|h_t\|, \epsilon)},
    \qquad
    \ell_t^{\mathrm{mse}} = \frac{1}{D_t} \big\| W^\top s_t - h_t \big\|^2
    $$

    with student features $s$ = `student_features`, teacher features $h$ =
    `teacher_features`, projection $W$ = `projection` (the identity when None) and
    $\epsilon = 10^{-8}$. The projection acts on the feature dimension
    only, one token at a time. ``"cosine"`` is DistilBERT's hidden-state loss (Sanh et al.
    2019), in $[0, 2]$ and invariant to positive rescaling of either vector; a zero vector
    gives 1. ``"mse"`` is the FitNets hint loss (Romero et al. 2015) with TinyBERT's learned
    linear map (Jiao et al. 2020), averaged over the $D_t$ teacher features. Tunix's feature
    projection strategy uses the MSE averaged over every element, padding included; here
    `where` keeps padding out and the result stays per token for `aggregate`.

    Gradients flow to the student features, to the projection and to the teacher features
    (stop the latter with `jax.lax.stop_gradient` if needed).

    Args:
      student_features: `[..., T, Ds]` student hidden states, any float dtype (computed in
        float32).
      teacher_features: `[..., T, Dt]` teacher hidden states at the same positions.
      projection: `[Ds, Dt]` learned map from the student's to the teacher's feature space;
        required when `Ds != Dt`.
      metric: ``"cosine"`` (default) or ``"mse"`` (static).
      where: `[..., T]` mask, True (or 1) = counts; masked positions give 0 and zero gradient
        (also to the projection), even with NaN features there.

    Returns:
      `[..., T]` per-token losses, float32 (float64 for float64 inputs).

    Examples:
      The projection is a parameter like any other: keep it in the params pytree and let the
      optimizer update it with the student.

      >>> import jax, jax.numpy as jnp, optax
      >>> from tunelib.losses import feature_matching_loss
      >>> student_h = jax.random.normal(jax.random.key(0), (2, 3, 4))  # Ds = 4
      >>> teacher_h = jnp.concatenate([student_h, -student_h], axis=-1)  # Dt = 8
      >>> params = {"projection": 0.1 * jax.random.normal(jax.random.key(1), (4, 8))}
      >>> def loss_fn(params):
      ...     per_token = feature_matching_loss(
      ...         student_h, teacher_h, projection=params["projection"], metric="cosine")
      ...     return per_token.mean()
      >>> optimizer = optax.adam(0.05)
      >>> opt_state = optimizer.init(params)
      >>> @jax.jit
      ... def step(params, opt_state):
      ...     grads = jax.grad(loss_fn)(params)
      ...     updates, opt_state = optimizer.update(grads, opt_state)
      ...     return optax.apply_updates(params, updates), opt_state
      >>> print(round(float(loss_fn(params)), 2))
      1.02
      >>> for _ in range(100):
      ...     params, opt_state = step(params, opt_state)
      >>> print(round(float(loss_fn(params)), 2))
      0.0

    References:
      Romero et al., "FitNets: Hints for Thin Deep Nets", 2015,
      https://arxiv.org/abs/1412.6550.
      Sanh et al., "DistilBERT, a distilled version of BERT: smaller, faster, cheaper and
      lighter", 2019, https://arxiv.org/abs/1910.01108.
      Jiao et al., "TinyBERT: Distilling BERT for Natural Language Understanding", 2020,
      https://arxiv.org/abs/1909.10351.
    """
    student = v.float_array(student_features, "student_features")
    teacher = v.float_array(teacher_features, "teacher_features")
    v.check_ndim(student, "student_features", at_least=2)
    v.check_ndim(teacher, "teacher_features", at_least=2)
    v.check_shape(
        teacher,
        "teacher_features",
        (*student.shape[:-1], teacher.shape[-1]),
        f"student_features {student.shape} in all but the feature size",
    )
    _check_metric(metric)
    projection = _checked_projection(
        projection, student, teacher, ("student_features", "teacher_features")
    )
    where = v.mask_array(where, student.shape[:-1])
    loss = _vector_loss(student, teacher, projection, metric, where)
    return jnp.where(where, loss, 0.0)


def attention_output_matching_loss(
    student_outputs: Float[ArrayLike, "*B T N Ds"],
    teacher_outputs: Float[ArrayLike, "*B T N Dt"],
    *,
    projection: Float[ArrayLike, "Ds Dt"] | None = None,
    metric: Metric = "cosine",
    where: Mask[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Per-token distance between per-head attention outputs, averaged over the heads.

    $$
    \ell_t = \frac{1}{N} \sum_{n=1}^{N} d\big(W^\top s_{t,n},\, h_{t,n}\big)
    $$

    with student head outputs $s$ = `student_outputs`, teacher head outputs $h$ =
    `teacher_outputs`, one projection $W$ = `projection` `[Ds, Dt]` shared by all $N$ heads
    and applied over the head dimension only, and $d$ the per-vector distance of
    `feature_matching_loss` chosen by `metric` (cosine distance, with the same $\epsilon$, or
    the mean squared error over the $D_t$ entries). Student and teacher must have the same
    number of heads $N$: head $n$ of the student is matched to head $n$ of the teacher. Tunix's
    attention transfer strategy also defaults to the cosine distance, averaged over all
    elements without a padding mask.

    Args:
      student_outputs: `[..., T, N, Ds]` per-head attention outputs of the student (before
        the output projection), any float dtype (computed in float32).
      teacher_outputs: `[..., T, N, Dt]` the teacher's, same `N`.
      projection: `[Ds, Dt]` learned map shared by the heads; required when `Ds != Dt`.
      metric: ``"cosine"`` (default) or ``"mse"`` (static).
      where: `[..., T]` mask, True (or 1) = counts; masked positions give 0 and zero gradient.

    Returns:
      `[..., T]` per-token losses, float32 (float64 for float64 inputs).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import attention_output_matching_loss
      >>> student = jnp.array([[[[1.0, 0.0], [0.0, 1.0]]]])  # B = T = 1, N = 2, Ds = 2
      >>> teacher = jnp.array([[[[2.0, 0.0, 0.0], [1.0, 0.0, 0.0]]]])  # Dt = 3
      >>> projection = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
      >>> print(attention_output_matching_loss(student, teacher, projection=projection))
      [[0.5]]

    References:
      Romero et al., "FitNets: Hints for Thin Deep Nets", 2015,
      https://arxiv.org/abs/1412.6550.
      Sanh et al., "DistilBERT, a distilled version of BERT: smaller, faster, cheaper and
      lighter", 2019, https://arxiv.org/abs/1910.01108.
    """
    student = v.float_array(student_outputs, "student_outputs")
    teacher = v.float_array(teacher_outputs, "teacher_outputs")
    v.check_ndim(student, "student_outputs", at_least=3)
    v.check_ndim(teacher, "teacher_outputs", at_least=3)
    if student.shape[-2] != teacher.shape[-2]:
        raise ValueError(
            f"student_outputs {student.shape} has N = {student.shape[-2]} heads but "
            f"teacher_outputs {teacher.shape} has N = {teacher.shape[-2]}; head n of the "
            "student is matched to head n of the teacher, so they must agree."
        )
    v.check_shape(
        teacher,
        "teacher_outputs",
        (*student.shape[:-1], teacher.shape[-1]),
        f"student_outputs {student.shape} in all but the head size",
    )
    _check_metric(metric)
    projection = _checked_projection(
        projection, student, teacher, ("student_outputs", "teacher_outputs")
    )
    where = v.mask_array(where, student.shape[:-2])
    per_head = _vector_loss(student, teacher, projection, metric, where[..., None])
    return jnp.where(where, jnp.mean(per_head, axis=-1), 0.0)
