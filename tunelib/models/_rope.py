"""Rotary position embeddings (RoPE) with linear, Llama 3, proportional and YaRN frequencies."""

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunelib.models._deepseek_config import check_positive_float, check_positive_int

# The parameters of each RoPE type that `DecoderConfig.rope_scaling` holds besides its
# `rope_type`, named as transformers names them in `rope_parameters`. `tunelib.formats` reads
# a `config.json` into these, filling in those transformers derives when they are left out.
ROPE_PARAMETERS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
    "proportional": ("factor", "partial_rotary_factor"),
    "yarn": (
        "factor",
        "beta_fast",
        "beta_slow",
        "original_max_position_embeddings",
        "truncate",
        "attention_factor",
        "mscale_all_dim",
    ),
}
# The parameters `rope_scaling` may leave out: only multi-head latent attention reads YaRN's
# `mscale_all_dim` (its softmax scale, as DeepSeek-V3 computes it).
_OPTIONAL = frozenset({"mscale_all_dim"})


def rope_frequencies(
    head_dim: int, *, theta: float | int, scaling: Mapping[str, Any] | None = None
) -> np.ndarray:
    r"""Per-pair rotary angular frequencies, with optional linear, Llama 3, proportional or
    YaRN scaling.

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
    * `{"rope_type": "yarn", "factor": s, "beta_fast": b_f, "beta_slow": b_s,
      "original_max_position_embeddings": L, "truncate", "attention_factor"}` (YaRN, gpt-oss),
      as `transformers` computes it: with $c(b) = D \ln(L / (2\pi b)) / (2 \ln\theta)$ the
      pair at which the wavelength fits $b$ times into $L$, the ramp runs from
      $l = \max(c(b_f), 0)$ to $h = \min(c(b_s), D - 1)$ (floor and ceiling first when
      `truncate`; $h = l + 0.001$ if they meet), $\rho_i = \mathrm{clip}((i - l) / (h - l),
      0, 1)$ and

    $$
    \omega_i' = \rho_i\, \omega_i / s + (1 - \rho_i)\, \omega_i
    $$

    so the fast pairs ($i < l$) keep their frequency and the slow ones ($i > h$) are
    interpolated by $s$. YaRN also scales every `cos` and `sin` by `attention_factor`
    (`rope_attention_factor`), which multiplies attention scores by its square.

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
      >>> yarn = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
      ...         "original_max_position_embeddings": 64, "truncate": False,
      ...         "attention_factor": 1.0}
      >>> print(rope_frequencies(8, theta=100.0, scaling=yarn).round(4))
      [1.     0.2125 0.0257 0.0079]

    References:
      Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021,
      https://arxiv.org/abs/2104.09864.
      Chen et al., "Extending Context Window of Large Language Models via Positional
      Interpolation", 2023, https://arxiv.org/abs/2306.15595.
      Grattafiori et al., "The Llama 3 Herd of Models", 2024, https://arxiv.org/abs/2407.21783.
      Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models", 2023,
      https://arxiv.org/abs/2309.00071.
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
    if scaling["rope_type"] == "yarn":
        return _yarn_frequencies(omega, head_dim, float(theta), scaling)
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * np.pi / omega
    gamma = np.clip((context / wavelength - low) / (high - low), 0.0, 1.0)
    return (1 - gamma) * omega / factor + gamma * omega


def _yarn_frequencies(
    omega: np.ndarray, head_dim: int, theta: float, scaling: Mapping[str, Any]
) -> np.ndarray:
    """YaRN's blend of `omega` and `omega / factor` (see `rope_frequencies`)."""
    context = float(scaling["original_max_position_embeddings"])

    def pair(rotations: float) -> float:
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair(float(scaling["beta_fast"])), pair(float(scaling["beta_slow"]))
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0.0, 1.0)
    return ramp * omega / float(scaling["factor"]) + (1 - ramp) * omega


def checked_rope_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A copy of `DecoderConfig.rope_scaling` with its keys (`ROPE_PARAMETERS`) and values
    checked, the legacy key `"type"` renamed `"rope_type"`."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise TypeError(f"rope_scaling must be None or a dict, got {scaling!r}.")
    scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_PARAMETERS:
        raise ValueError(
            f"rope_scaling['rope_type'] must be one of {tuple(ROPE_PARAMETERS)}, got {rope_type!r}."
        )
    keys = [k for k in ROPE_PARAMETERS[rope_type] if k in scaling or k not in _OPTIONAL]
    if set(scaling) != {"rope_type", *keys}:
        raise ValueError(
            f"rope_scaling of type {rope_type!r} must have exactly the keys "
            f"{sorted({'rope_type', *keys})}, got {sorted(scaling)}."
        )
    for key in keys:
        if key == "original_max_position_embeddings":
            check_positive_int(scaling[key], f"rope_scaling[{key!r}]")
        elif key == "truncate":
            if not isinstance(scaling[key], bool):
                raise TypeError(f"rope_scaling['truncate'] must be a bool, got {scaling[key]!r}.")
        else:
            check_positive_float(scaling[key], f"rope_scaling[{key!r}]")
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(
            "rope_scaling['high_freq_factor'] must be > rope_scaling['low_freq_factor'], got "
            f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}."
        )
    if rope_type == "proportional" and not scaling["partial_rotary_factor"] <= 1:
        raise ValueError(
            "rope_scaling['partial_rotary_factor'] must be in (0, 1], got "
            f"{scaling['partial_rotary_factor']}."
        )
    return scaling


def rope_attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """The factor every `cos` and `sin` is multiplied by: YaRN's `attention_factor`, else 1."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    return float(scaling["attention_factor"])


def rope_angles(
    positions: jax.Array, frequencies: np.ndarray, dtype: jnp.dtype, scale: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """`cos` and `sin` of `positions[..., None] * frequencies`, each `[B, T, D/2]` in `dtype`
    and multiplied by `scale` (`rope_attention_factor`) when it is not 1."""
    angles = positions.astype(dtype)[..., None] * jnp.asarray(frequencies, dtype)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale == 1.0:
        return cos, sin
    return cos * jnp.asarray(scale, dtype), sin * jnp.asarray(scale, dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the channel pairs `(i, i + D/2)` of `x [B, T, heads, D]` by the given angles.

    Runs in the dtype of `cos` (at least float32) and returns the dtype of `x`.
    """
    half = x.shape[-1] // 2
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    first, second = x[..., :half].astype(cos.dtype), x[..., half:].astype(cos.dtype)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
