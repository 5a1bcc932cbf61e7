"""Rotary position embeddings (RoPE) with linear, Llama 3 and proportional frequencies."""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def rope_frequencies(
    head_dim: int, *, theta: float | int, scaling: Mapping[str, Any] | None = None
) -> np.ndarray:
    r"""Per-pair rotary angular frequencies, with optional linear or Llama 3 scaling.

    $$
    \omega_i = \theta^{-2i/D}, \qquad i = 0, \dots, D/2 - 1
    $$

    with $D$ = `head_dim` and $\theta$ = `theta`. A position $p$ rotates the pair of
    channels $(i, i + D/2)$ of every query and key head by the angle $p\,\omega_i$ (the
    "rotate half" layout of Hugging Face checkpoints, not the interleaved pairs of Meta's
    reference code). `scaling` (a checked `DecoderConfig.rope_scaling`) changes the
    frequencies:

    * `{"rope_type": "linear", "factor": s}` (position interpolation, Chen et al. 2023):
      $\omega_i' = \omega_i / s$.
    * `{"rope_type": "llama3", ...}` (Llama 3.1): with $s$ = `factor`, $\alpha$ =
      `low_freq_factor`, $\beta$ = `high_freq_factor`, $L$ =
      `original_max_position_embeddings` and wavelength $\lambda_i = 2\pi / \omega_i$,

    $$
    \omega_i' = \begin{cases}
    \omega_i & \lambda_i < L / \beta \\
    \omega_i / s & \lambda_i > L / \alpha \\
    (1 - \gamma_i)\, \omega_i / s + \gamma_i\, \omega_i &
    \text{otherwise, } \gamma_i = \dfrac{L / \lambda_i - \alpha}{\beta - \alpha}
    \end{cases}
    $$

    so high frequencies (short wavelengths) are kept, low ones are interpolated by $s$, and
    the band between is blended smoothly ($\gamma_i$ runs from 0 to 1 across it).
    * `{"rope_type": "proportional", "factor": s, "partial_rotary_factor": p}` (Gemma 4's
      full-attention layers): the first $r = \lfloor p D / 2 \rfloor$ pairs keep
      $\omega_i / s$ (still with exponent $2i/D$ over the whole head) and the other
      $D/2 - r$ do not rotate ($\omega_i = 0$).

    Args:
      head_dim: $D$, even.
      theta: the base $\theta > 0$.
      scaling: None or a `rope_scaling` dict as described above.

    Returns:
      `[D/2]` float64 frequencies, a static NumPy array.

    Examples:
      >>> from tunelib.models import rope_frequencies
      >>> print(rope_frequencies(4, theta=100.0))
      [1.  0.1]
      >>> print(rope_frequencies(4, theta=100.0, scaling={"rope_type": "linear", "factor": 2.0}))
      [0.5  0.05]
      >>> proportional = {"rope_type": "proportional", "factor": 1.0, "partial_rotary_factor": 0.5}
      >>> print(rope_frequencies(8, theta=100.0, scaling=proportional))
      [1.         0.31622777 0.         0.        ]

    References:
      Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021,
      https://arxiv.org/abs/2104.09864.
      Chen et al., "Extending Context Window of Large Language Models via Positional
      Interpolation", 2023, https://arxiv.org/abs/2306.15595.
      Grattafiori et al., "The Llama 3 Herd of Models", 2024, https://arxiv.org/abs/2407.21783.
    """
    omega = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return omega
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return omega / factor
    if scaling["rope_type"] == "proportional":
        rotated = int(float(scaling["partial_rotary_factor"]) * head_dim // 2)
        return np.where(np.arange(head_dim // 2) < rotated, omega, 0.0) / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * np.pi / omega
    gamma = np.clip((context / wavelength - low) / (high - low), 0.0, 1.0)
    return (1 - gamma) * omega / factor + gamma * omega


def rope_angles(
    positions: jax.Array, frequencies: np.ndarray, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """`cos` and `sin` of `positions[..., None] * frequencies`, each `[B, T, D/2]` in `dtype`."""
    angles = positions.astype(dtype)[..., None] * jnp.asarray(frequencies, dtype)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the channel pairs `(i, i + D/2)` of `x [B, T, heads, D]` by the given angles.

    Runs in the dtype of `cos` (at least float32) and returns the dtype of `x`.
    """
    half = x.shape[-1] // 2
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    first, second = x[..., :half].astype(cos.dtype), x[..., half:].astype(cos.dtype)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
