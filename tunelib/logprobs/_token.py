"""Per-token log-probabilities and entropy from logits."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar


def _scaled_logits(
    logits: ArrayLike, temperature: Scalar, where: ArrayLike | None
) -> tuple[jax.Array, jax.Array]:
    """Checked logits / temperature in at least float32, masked positions replaced by 0."""
    logits = v.float_array(logits, "logits")
    v.check_ndim(logits, "logits", at_least=2)
    v.positive_scalar(temperature, "temperature")
    where = v.mask_array(where, logits.shape[:-1])
    dtype = v.compute_dtype(logits.dtype)
    scaled = logits.astype(dtype) / jnp.asarray(temperature, dtype)
    return jnp.where(where[..., None], scaled, 0.0), where


def token_logps(
    logits: Float[ArrayLike, "*B T V"],
    targets: Int[ArrayLike, "*B T"],
    *,
    temperature: Scalar = 1.0,
    where: Mask[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Log-probability of each target token under the tempered softmax of the logits.

    $$
    \log \pi(y_t) = z_{t, y_t} / \tau - \log \sum_v \exp(z_{t, v} / \tau)
    $$

    with logits $z$ = `logits`, targets $y$ = `targets` and temperature
    $\tau$ = `temperature`. The log-sum-exp runs in float32 (float64 for float64 input)
    whatever the input dtype.

    Args:
      logits: `[..., T, V]` unnormalised scores.
      targets: `[..., T]` integer token ids in `[0, V)`. An id outside that range at a counted
        position is a `ValueError` naming the id and V when the ids can be read (outside
        `jax.jit`); under `jit` it cannot be seen, and the position's log-prob is NaN, so
        that the loss built on it is NaN rather than quietly wrong (its gradient is 0).
      temperature: `tau > 0`; may be a traced scalar.
      where: `[..., T]` mask, True (or 1) = counts. Masked positions give exactly 0 and a zero
        gradient even when their logits are `-inf` or NaN, and their targets may be any value
        (for example an ignore index of -100).

    Returns:
      `[..., T]` log-probabilities, float32 (float64 for float64 logits).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.logprobs import token_logps
      >>> logits = jnp.array([[[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
      >>> print(token_logps(logits, jnp.array([[0, 2]])).round(4))
      [[-0.2395 -1.0986]]
    """
    scaled, where = _scaled_logits(logits, temperature, where)
    targets = v.int_array(targets, "targets")
    v.check_shape(targets, "targets", scaled.shape[:-1], f"logits {scaled.shape} without V")
    safe_targets, inside = v.token_id_array(targets, scaled.shape[-1], where)
    target_logits = jnp.take_along_axis(scaled, safe_targets[..., None], axis=-1)[..., 0]
    logps = target_logits - jax.nn.logsumexp(scaled, axis=-1)
    return jnp.where(where, jnp.where(inside, logps, jnp.nan), 0.0)


def token_entropy(
    logits: Float[ArrayLike, "*B T V"],
    *,
    temperature: Scalar = 1.0,
    where: Mask[ArrayLike, "*B T"] | None = None,
) -> Float[Array, "*B T"]:
    r"""Entropy of the tempered next-token distribution at each position.

    $$
    H_t = -\sum_v \pi_{t, v} \log \pi_{t, v}
    = \log \sum_v e^{z_{t, v}/\tau} - \sum_v \pi_{t, v} \, z_{t, v} / \tau
    $$

    with $\pi_t = \mathrm{softmax}(z_t / \tau)$. Vocabulary entries whose logit is `-inf`
    (forbidden tokens) have probability 0 and contribute 0, with a finite gradient.

    Args:
      logits: `[..., T, V]` unnormalised scores.
      temperature: `tau > 0`; may be a traced scalar.
      where: `[..., T]` mask, True (or 1) = counts; masked positions give 0.

    Returns:
      `[..., T]` entropies in nats, float32 (float64 for float64 logits).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.logprobs import token_entropy
      >>> print(token_entropy(jnp.zeros((1, 1, 4))).round(4))  # uniform over 4: log 4
      [[1.3863]]
    """
    scaled, where = _scaled_logits(logits, temperature, where)
    probs = jax.nn.softmax(scaled, axis=-1)
    finite = jnp.where(jnp.isfinite(scaled), scaled, 0.0)
    entropy = jax.nn.logsumexp(scaled, axis=-1) - jnp.sum(probs * finite, axis=-1)
    return jnp.where(where, entropy, 0.0)
