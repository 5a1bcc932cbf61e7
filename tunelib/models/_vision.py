"""Gemma 4's vision encoder and the embedder of its soft tokens into the language model."""

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int

from tunelib import _validation as v
from tunelib.models._config import DecoderConfig
from tunelib.models._layers import Dense, RMSNorm, activation, kernel_init, param
from tunelib.models._rope import apply_rope, rope_angles, rope_frequencies
from tunelib.models._vision_config import VisionConfig


class ClipBound(nnx.Variable):
    """A clamp bound of a clipped projection: read from a checkpoint, never trained."""


class ClippedDense(nnx.Module):
    r"""`clip(clip(x, a, b) @ W, c, d)` with the bounds of a checkpoint (`use_clipped_linears`);
    a plain product without them. The kernel is `linear`, as transformers names it."""

    def __init__(self, features_in: int, features_out: int, names, config, *, rngs: nnx.Rngs):
        self.linear = Dense(features_in, features_out, names, config, use_bias=False, rngs=rngs)
        if config.use_clipped_linears:
            dtype = config.storage_dtype
            for name, value in (
                ("input_min", -jnp.inf),
                ("input_max", jnp.inf),
                ("output_min", -jnp.inf),
                ("output_max", jnp.inf),
            ):
                setattr(self, name, ClipBound(jnp.asarray(value, dtype)))
        self.clipped = config.use_clipped_linears

    def __call__(self, x: jax.Array) -> jax.Array:
        if not self.clipped:
            return self.linear(x)
        x = jnp.clip(x, self.input_min[...].astype(x.dtype), self.input_max[...].astype(x.dtype))
        y = self.linear(x)
        return jnp.clip(
            y, self.output_min[...].astype(y.dtype), self.output_max[...].astype(y.dtype)
        )


class VisionAttention(nnx.Module):
    """Bidirectional grouped-query attention over an image's patches, with QK-norm, an
    unscaled value norm, axial 2-D RoPE and unscaled scores (Gemma 4's vision attention)."""

    def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
        c = config
        h, d = c.hidden_size, c.head_dim
        self.num_kv_heads, self.head_dim = c.num_key_value_heads, d
        self.q_proj = ClippedDense(h, c.num_attention_heads * d, ("embed", "q_heads"), c, rngs=rngs)
        self.k_proj = ClippedDense(
            h, c.num_key_value_heads * d, ("embed", "kv_heads"), c, rngs=rngs
        )
        self.v_proj = ClippedDense(
            h, c.num_key_value_heads * d, ("embed", "kv_heads"), c, rngs=rngs
        )
        self.o_proj = ClippedDense(c.num_attention_heads * d, h, ("q_heads", "embed"), c, rngs=rngs)
        self.q_norm = RMSNorm(d, "head_dim", c, rngs=rngs)
        self.k_norm = RMSNorm(d, "head_dim", c, rngs=rngs)
        self.v_norm = RMSNorm(d, "head_dim", c, scaled=False, rngs=rngs)

    def __call__(self, x, angles, allowed):
        d = self.head_dim
        q = _rope_2d(self.q_norm(rearrange(self.q_proj(x), "b p (n d) -> b p n d", d=d)), angles)
        k = _rope_2d(self.k_norm(rearrange(self.k_proj(x), "b p (k d) -> b p k d", d=d)), angles)
        val = self.v_norm(rearrange(self.v_proj(x), "b p (k d) -> b p k d", d=d))
        q = rearrange(q, "b p (k g) d -> b k g p d", k=self.num_kv_heads)
        high = v.compute_dtype(q.dtype)
        scores = jnp.einsum("bkgpd,bskd->bkgps", q, k, preferred_element_type=high)
        scores = jnp.where(allowed, scores, jnp.finfo(high).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(val.dtype)
        out = jnp.einsum("bkgps,bskd->bpkgd", weights, val)
        return self.o_proj(rearrange(out, "b p k g d -> b p (k g d)"))


class VisionEncoderLayer(nnx.Module):
    """A pre-norm encoder layer with Gemma's sandwich norms around attention and the MLP."""

    def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
        c = config
        h = c.hidden_size
        self.self_attn = VisionAttention(c, rngs=rngs)
        self.mlp = VisionMLP(c, rngs=rngs)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            setattr(self, name, RMSNorm(h, "embed", c, rngs=rngs))

    def __call__(self, x, angles, allowed):
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), angles, allowed)
        )
        y = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(y)


class VisionMLP(nnx.Module):
    r"""The gated MLP $W_d\,(\phi(x W_g) \odot x W_u)$ of an encoder layer."""

    def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
        c = config
        h, f = c.hidden_size, c.intermediate_size
        self.gate_proj = ClippedDense(h, f, ("embed", "mlp"), c, rngs=rngs)
        self.up_proj = ClippedDense(h, f, ("embed", "mlp"), c, rngs=rngs)
        self.down_proj = ClippedDense(f, h, ("mlp", "embed"), c, rngs=rngs)
        self.act = c.hidden_activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))


class PatchEmbedder(nnx.Module):
    r"""$W_{\mathrm{in}} (2 x - 1) + P^{(0)}_u + P^{(1)}_v$ per patch, the position
    embeddings 0 on padding patches."""

    def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.input_proj = Dense(
            3 * c.patch_size**2, c.hidden_size, ("patch", "embed"), c, use_bias=False, rngs=rngs
        )
        self.position_embedding_table = param(
            rngs,
            kernel_init(c),
            (2, c.position_embedding_size, c.hidden_size),
            (None, None, "embed"),
            c.storage_dtype,
        )

    def __call__(self, pixels: jax.Array, clamped: jax.Array, real: jax.Array) -> jax.Array:
        table = self.position_embedding_table[...].astype(self.config.compute_dtype)
        embedded = table[0][clamped[..., 0]] + table[1][clamped[..., 1]]
        return self.input_proj(2 * (pixels - 0.5)) + jnp.where(real[..., None], embedded, 0)


class VisionEncoder(nnx.Module):
    r"""Gemma 4's vision encoder: image patches to soft tokens of width $C$.

    With patches $x_i \in [0, 1]^{3p^2}$ at grid positions $(u_i, v_i)$:

    $$
    \begin{aligned}
    e_i &= W_{\mathrm{in}} (2 x_i - 1) + P^{(0)}_{u_i} + P^{(1)}_{v_i} \\
    h &= \mathrm{Layers}(e) \quad \text{(bidirectional over the image's real patches)} \\
    s_j &= \sqrt{C}\, \frac{1}{k^2} \sum_{i:\ (\lfloor u_i/k \rfloor,\, \lfloor v_i/k
      \rfloor) = j} h_i, \qquad \text{(with \texttt{standardize}: } (s_j - \beta) \odot
      \gamma)
    \end{aligned}
    $$

    Each layer is pre-norm attention and a gated MLP, each wrapped in Gemma's sandwich
    norms; attention normalises queries, keys (learned scales) and values (none) over the
    head, rotates the first half of every query and key head by the patch's column $u$ and
    the second half by its row $v$ (axial RoPE, base `rope_theta`), and scores $q \cdot k$
    unscaled. Soft token $j$ averages a $k \times k$ window of patches, numbered row by row
    over the pooled grid, as transformers' `Gemma4VisionModel` does.

    Args:
      config: the `VisionConfig`.
      rngs: the `nnx.Rngs` the weights are drawn from.

    Examples:
      >>> import numpy as np
      >>> from flax import nnx
      >>> from tunelib.data import gemma4_image_inputs
      >>> from tunelib.models import VisionConfig, VisionEncoder
      >>> cfg = VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
      ...                    num_attention_heads=2, num_key_value_heads=2, head_dim=8,
      ...                    patch_size=2, pooling_kernel_size=2, position_embedding_size=16)
      >>> images = [np.zeros((8, 12, 3), np.uint8), np.zeros((4, 2, 3), np.uint8)]
      >>> inputs = gemma4_image_inputs(images, patch_size=2, max_soft_tokens=6,
      ...                              pooling_kernel_size=2)
      >>> features, where = VisionEncoder(cfg, rngs=nnx.Rngs(0))(
      ...     inputs["pixel_values"], inputs["image_position_ids"])
      >>> features.shape, where.sum(-1).tolist(), inputs["num_soft_tokens_per_image"]
      ((2, 6, 16), [6, 3], [6, 3])

    References:
      transformers 5.25, `models/gemma4/modeling_gemma4.py`, `Gemma4VisionModel`.
      Heo et al., "Rotary Position Embedding for Vision Transformer", 2024,
      https://arxiv.org/abs/2403.13298.
    """

    def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, VisionConfig):
            raise TypeError(f"config must be a VisionConfig, got {type(config).__name__}.")
        c = self.config = config
        self.patch_embedder = PatchEmbedder(c, rngs=rngs)
        self.layers = nnx.List(
            [VisionEncoderLayer(c, rngs=rngs) for _ in range(c.num_hidden_layers)]
        )
        if c.standardize:
            self.std_bias = param(
                rngs, jax.nn.initializers.zeros, (c.hidden_size,), ("embed",), c.storage_dtype
            )
            self.std_scale = param(
                rngs, jax.nn.initializers.ones, (c.hidden_size,), ("embed",), c.storage_dtype
            )

    def __call__(
        self,
        pixel_values: Float[ArrayLike, "I N Q"],
        image_position_ids: Int[ArrayLike, "I N 2"],
    ) -> tuple[Float[Array, "I L C"], Bool[Array, "I L"]]:
        """The soft tokens of each image and which of them are real.

        Args:
          pixel_values: `[I, N, 3 p^2]` patches in [0, 1], as
            `tunelib.data.gemma4_image_inputs` returns them (padded to N rows).
          image_position_ids: `[I, N, 2]` (column, row) of each patch, (-1, -1) on padding.

        Returns:
          `([I, L, C] soft tokens, [I, L] mask)` with `L = N // k**2`: image i's
          `num_soft_tokens_per_image[i]` soft tokens come first, the mask is True on them
          (padding slots are 0 before standardisation). In float32 (the pooled features
          are scaled by $\\sqrt{C}$), or float64 for a float64 model.
        """
        c = self.config
        pixels = v.float_array(pixel_values, "pixel_values")
        positions = v.int_array(image_position_ids, "image_position_ids")
        if pixels.ndim != 3 or pixels.shape[-1] != 3 * c.patch_size**2:
            raise ValueError(
                f"pixel_values must have shape [I, N, {3 * c.patch_size**2}] (patches of "
                f"{c.patch_size}x{c.patch_size}x3), got {pixels.shape}."
            )
        v.check_shape(positions, "image_position_ids", (*pixels.shape[:2], 2), "[I, N, 2]")
        k = c.pooling_kernel_size
        if pixels.shape[1] % (k * k):
            raise ValueError(
                f"pixel_values has {pixels.shape[1]} patch rows, not a multiple of "
                f"pooling_kernel_size**2 = {k * k}."
            )
        real = ~(positions == -1).all(-1)  # [I, N]
        clamped = jnp.maximum(positions, 0)
        x = self.patch_embedder(pixels, clamped, real)
        high = v.compute_dtype(c.compute_dtype)
        frequencies = rope_frequencies(c.head_dim // 2, theta=c.rope_theta)
        angles = tuple(rope_angles(positions[..., axis], frequencies, high) for axis in (0, 1))
        allowed = rearrange(real, "i s -> i 1 1 1 s")
        for layer in self.layers:
            x = layer(x, angles, allowed)
        return self._pool(x, clamped, real)

    def _pool(self, x, clamped, real):
        """Average `k x k` windows of patches into soft tokens, scaled by sqrt(C)."""
        c = self.config
        k = c.pooling_kernel_size
        length = x.shape[1] // (k * k)
        high = v.compute_dtype(x.dtype)
        x = jnp.where(real[..., None], x, 0).astype(high)
        columns = jnp.max(clamped[..., 0], axis=-1, keepdims=True) + 1
        window = clamped // k
        index = window[..., 0] + (columns // k) * window[..., 1]  # [I, N]
        weights = jax.nn.one_hot(index, length, dtype=high) / (k * k)  # [I, N, L]
        pooled = jnp.einsum("inl,inc->ilc", weights, x, preferred_element_type=high)
        where = (weights != 0).any(axis=1)
        pooled = pooled * jnp.asarray(c.hidden_size**0.5, high)
        if c.standardize:
            pooled = (pooled - self.std_bias[...].astype(high)) * self.std_scale[...].astype(high)
        return pooled, where


class MultimodalEmbedder(nnx.Module):
    r"""Soft tokens into the language model's embedding space: $W\, \mathrm{RMSNorm}(s)$,
    the norm without a learned scale (transformers' `Gemma4MultimodalEmbedder`).

    Args:
      vision_config: the encoder's `VisionConfig` (its width $C$ and $\epsilon$).
      text_config: the language model's `DecoderConfig` (its width $H$ and dtypes).
      rngs: the `nnx.Rngs` the projection is drawn from.
    """

    def __init__(self, vision_config: VisionConfig, text_config: DecoderConfig, *, rngs: nnx.Rngs):
        c = vision_config
        self.embedding_pre_projection_norm = RMSNorm(
            c.hidden_size, "embed", c, scaled=False, rngs=rngs
        )
        self.embedding_projection = Dense(
            c.hidden_size,
            text_config.hidden_size,
            ("vision_embed", "embed"),
            text_config,
            use_bias=False,
            rngs=rngs,
        )

    def __call__(self, soft_tokens: Float[ArrayLike, "*B C"]) -> Float[Array, "*B H"]:
        """`[..., C]` soft tokens to `[..., H]` embeddings in the text model's compute dtype."""
        normed = self.embedding_pre_projection_norm(v.float_array(soft_tokens, "soft_tokens"))
        return self.embedding_projection(normed)


def _rope_2d(x: jax.Array, angles) -> jax.Array:
    """Rotate the first half of each head of `x [B, P, heads, D]` by the column angles and
    the second half by the row angles (`rotate half` within each half)."""
    half = x.shape[-1] // 2
    (cos_u, sin_u), (cos_v, sin_v) = angles
    return jnp.concatenate(
        [apply_rope(x[..., :half], cos_u, sin_u), apply_rope(x[..., half:], cos_v, sin_v)], -1
    )
