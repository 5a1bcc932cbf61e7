"""Supervised fine-tuning: token-level negative log-likelihood."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar


def nll_loss(
    logits: Float[ArrayLike, "*B T V"],
    targets: Int[ArrayLike, "*B T"],
    *,
    label_smoothing: Scalar = 0.0,
    z_loss_weight: Scalar = 0.0,
    where: Mask[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Per-token negative log-likelihood with optional label smoothing and z-loss.

    $$
    \ell_t = -(1 - \varepsilon) \log p_{t, y_t}
    - \frac{\varepsilon}{V} \sum_{v=1}^{V} \log p_{t, v}
    + \lambda_z \big(\log Z_t\big)^2,
    \qquad p_t = \mathrm{softmax}(z_t), \quad \log Z_t = \log \sum_v e^{z_{t,v}}
    $$

    with logits $z$ = `logits`, targets $y$ = `targets`, $\varepsilon$ =
    `label_smoothing` (Szegedy et al. 2016; the target mixes the one-hot label with the uniform
    distribution over all $V$ classes, as in PyTorch's `label_smoothing`) and
    $\lambda_z$ = `z_loss_weight` (the auxiliary z-loss of PaLM, Chowdhery et al. 2022,
    who use $10^{-4}$), which keeps the softmax normaliser near 1.

    Args:
      logits: `[..., T, V]` unnormalised scores, any float dtype (computed in float32).
      targets: `[..., T]` integer token ids in `[0, V)`. An id outside that range at a counted
        position is a `ValueError` when the ids can be read (outside `jax.jit`); under `jit`
        the position's loss is NaN (see `tunelib.logprobs.token_logps`).
      label_smoothing: $\varepsilon \in [0, 1]$; may be traced.
      z_loss_weight: $\lambda_z \ge 0$; may be traced.
      where: `[..., T]` mask, True (or 1) = counts. Masked positions give exactly 0 and zero
        gradient, even with `-inf`/NaN logits or any target (e.g. -100) there.

    Returns:
      `[..., T]` per-token losses, float32 (float64 for float64 logits); reduce them with
      `tunelib.losses.aggregate`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import nll_loss
      >>> logits = jnp.array([[[2.0, 0.0, 0.0]]])
      >>> print(nll_loss(logits, jnp.array([[0]])).round(4))
      [[0.2395]]
      >>> print(nll_loss(logits, jnp.array([[0]]), label_smoothing=0.3).round(4))
      [[0.6395]]

    References:
      Szegedy et al., "Rethinking the Inception Architecture for Computer Vision", 2016,
      https://arxiv.org/abs/1512.00567.
      Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", 2022,
      https://arxiv.org/abs/2204.02311.
    """
    logits = v.float_array(logits, "logits")
    v.check_ndim(logits, "logits", at_least=2)
    targets = v.int_array(targets, "targets")
    v.check_shape(targets, "targets", logits.shape[:-1], f"logits {logits.shape} without V")
    v.unit_interval(label_smoothing, "label_smoothing")
    where = v.mask_array(where, targets.shape)
    dtype = v.compute_dtype(logits.dtype)
    logits = jnp.where(where[..., None], logits.astype(dtype), 0.0)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    safe_targets, inside = v.token_id_array(targets, logits.shape[-1], where)
    target_logits = jnp.take_along_axis(logits, safe_targets[..., None], axis=-1)[..., 0]
    nll = log_z - target_logits
    uniform_nll = log_z - jnp.mean(logits, axis=-1)
    eps = jnp.asarray(label_smoothing, dtype)
    loss = (1 - eps) * nll + eps * uniform_nll + jnp.asarray(z_loss_weight, dtype) * log_z**2
    return jnp.where(where, jnp.where(inside, loss, jnp.nan), 0.0)
