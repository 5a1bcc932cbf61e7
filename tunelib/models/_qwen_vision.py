"""Qwen3.5's vision encoder: 3-D patches, resampled learned positions, 2-D RoPE, 2x2 merger."""

import math

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int

from tunelib import _validation as v
from tunelib.models._layers import Dense, activation, kernel_init, param
from tunelib.models._qwen_vision_config import QwenVisionConfig
from tunelib.models._rope import apply_rope, rope_angles, rope_frequencies


class LayerNorm(nnx.Module):
    r"""$\mathrm{cast}\big((x - \mu) / \sqrt{\sigma^2 + \epsilon}\big) \odot g + b$ over the
    last axis, the statistics in at least float32 ($\epsilon = 10^{-6}$, Qwen's)."""

    def __init__(self, dim: int, config: QwenVisionConfig, *, rngs: nnx.Rngs):
        self.dtype = config.compute_dtype
        dtype = config.storage_dtype
        self.scale = param(rngs, jax.nn.initializers.ones, (dim,), ("embed",), dtype)
        self.bias = param(rngs, jax.nn.initializers.zeros, (dim,), ("embed",), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        high = x.astype(v.compute_dtype(x.dtype))
        mean = jnp.mean(high, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(high - mean), axis=-1, keepdims=True)
        normed = ((high - mean) * jax.lax.rsqrt(var + 1e-6)).astype(self.dtype)
        return normed * self.scale[...].astype(self.dtype) + self.bias[...].astype(self.dtype)


class QwenVisionAttention(nnx.Module):
    """Bidirectional multi-head attention within each frame of an image, fused q/k/v with
    biases, 2-D RoPE over the whole head, scores scaled by 1/sqrt(D)."""

    def __init__(self, config: QwenVisionConfig, *, rngs: nnx.Rngs):
        c = config
        self.head_dim = c.head_dim
        self.qkv = Dense(c.hidden_size, 3 * c.hidden_size, ("embed", "q_heads"), c,
                         use_bias=True, rngs=rngs)  # fmt: skip
        self.proj = Dense(c.hidden_size, c.hidden_size, ("q_heads", "embed"), c,
                          use_bias=True, rngs=rngs)  # fmt: skip

    def __call__(self, x, cos, sin, allowed):
        q, k, val = rearrange(self.qkv(x), "b n (three k d) -> three b n k d", three=3,
                              d=self.head_dim)  # fmt: skip
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        high = v.compute_dtype(q.dtype)
        scores = jnp.einsum("bpkd,bskd->bkps", q, k, preferred_element_type=high)
        scores = scores * jnp.asarray(self.head_dim**-0.5, high)
        scores = jnp.where(allowed, scores, jnp.finfo(high).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(val.dtype)
        out = jnp.einsum("bkps,bskd->bpkd", weights, val)
        return self.proj(rearrange(out, "b p k d -> b p (k d)"))


class QwenVisionMLP(nnx.Module):
    r"""$W_2\, \phi(W_1 x + b_1) + b_2$."""

    def __init__(self, config: QwenVisionConfig, *, rngs: nnx.Rngs):
        c = config
        self.linear_fc1 = Dense(c.hidden_size, c.intermediate_size, ("embed", "mlp"), c,
                                use_bias=True, rngs=rngs)  # fmt: skip
        self.linear_fc2 = Dense(c.intermediate_size, c.hidden_size, ("mlp", "embed"), c,
                                use_bias=True, rngs=rngs)  # fmt: skip
        self.act = c.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_fc2(activation(self.act)(self.linear_fc1(x)))


class QwenVisionBlock(nnx.Module):
    """A pre-norm encoder layer (LayerNorms with biases)."""

    def __init__(self, config: QwenVisionConfig, *, rngs: nnx.Rngs):
        self.norm1 = LayerNorm(config.hidden_size, config, rngs=rngs)
        self.norm2 = LayerNorm(config.hidden_size, config, rngs=rngs)
        self.attn = QwenVisionAttention(config, rngs=rngs)
        self.mlp = QwenVisionMLP(config, rngs=rngs)

    def __call__(self, x, cos, sin, allowed):
        x = x + self.attn(self.norm1(x), cos, sin, allowed)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    r"""$W_2\, \mathrm{GELU}(W_1\, [\mathrm{LN}(h_{4j}); \dots; \mathrm{LN}(h_{4j+3})] + b_1)
    + b_2$: each window of $m^2$ consecutive patches into one token (exact GELU)."""

    def __init__(self, config: QwenVisionConfig, *, rngs: nnx.Rngs):
        c = config
        wide = c.hidden_size * c.spatial_merge_size**2
        self.norm = LayerNorm(c.hidden_size, c, rngs=rngs)
        self.linear_fc1 = Dense(wide, wide, ("mlp", "mlp"), c, use_bias=True, rngs=rngs)
        self.linear_fc2 = Dense(wide, c.out_hidden_size, ("mlp", "embed"), c, use_bias=True,
                                rngs=rngs)  # fmt: skip
        self.window = c.spatial_merge_size**2

    def __call__(self, x: jax.Array) -> jax.Array:
        x = rearrange(self.norm(x), "(n w) c -> n (w c)", w=self.window)
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False))


class QwenVisionEncoder(nnx.Module):
    r"""Qwen3.5's vision encoder and merger: image patches to tokens of the language model.

    With patch $x_n \in \mathbb{R}^{C_{in} T p^2}$ of image $i$ at grid cell
    $(r_n, c_n)$ of its $g_h \times g_w$ grid:

    $$
    \begin{aligned}
    e_n &= W_{\mathrm{in}} x_n + b + \sum_{a, b \in \{0, 1\}} \lambda_{ab}(r_n, c_n)\,
      P_{\lfloor \rho_n \rfloor + a,\ \lfloor \gamma_n \rfloor + b}, \quad
      \rho_n = \frac{r_n (s - 1)}{\max(g_h - 1, 1)},\ \gamma_n = \frac{c_n (s-1)}{\max(g_w
      - 1, 1)} \\
    h &= \mathrm{Blocks}(e) \quad \text{(bidirectional within each frame of each image)} \\
    y_j &= \mathrm{Merger}(h_{m^2 j}, \dots, h_{m^2 j + m^2 - 1})
    \end{aligned}
    $$

    The patch embedding is transformers' `Conv3d` (kernel = stride = $(T, p, p)$) as one
    product; the $s \times s$ learned position table $P$ is resampled bilinearly (corners
    aligned, $\lambda$ the bilinear weights) to each image's grid; each block is pre-norm
    attention and MLP with LayerNorms; attention rotates the first half of every head's
    rotary pairs by the row $r_n$ and the second by the column $c_n$ (axial RoPE, base
    `rope_theta`, over the whole head). Patches come window by window
    (`tunelib.data.qwen_vl_image_inputs`), so each $m \times m$ window is $m^2$
    consecutive rows and the merger concatenates them.

    Args:
      config: the `QwenVisionConfig`.
      rngs: the `nnx.Rngs` the weights are drawn from.

    Examples:
      >>> import numpy as np
      >>> from flax import nnx
      >>> from tunelib.data import qwen_vl_image_inputs
      >>> from tunelib.models import QwenVisionConfig, QwenVisionEncoder
      >>> cfg = QwenVisionConfig(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
      ...                        patch_size=2, out_hidden_size=24, num_position_embeddings=16)
      >>> images = [np.zeros((8, 12, 3), np.uint8), np.zeros((8, 8, 3), np.uint8)]
      >>> inputs = qwen_vl_image_inputs(images, patch_size=2, min_pixels=16, max_pixels=96)
      >>> features, where = QwenVisionEncoder(cfg, rngs=nnx.Rngs(0))(
      ...     inputs["pixel_values"], inputs["image_grid_thw"])
      >>> features.shape, int(where.sum()), inputs["num_soft_tokens_per_image"]
      ((10, 24), 10, [6, 4])

    References:
      transformers 5.25, `models/qwen3_5/modeling_qwen3_5.py`, `Qwen3_5VisionModel`, and
      `vision_utils.py`.
      Wang et al., "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at
      Any Resolution", 2024, https://arxiv.org/abs/2409.12191.
    """

    def __init__(self, config: QwenVisionConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, QwenVisionConfig):
            raise TypeError(f"config must be a QwenVisionConfig, got {type(config).__name__}.")
        c = self.config = config
        self.patch_embed = Dense(c.patch_width, c.hidden_size, ("patch", "embed"), c,
                                 use_bias=True, rngs=rngs)  # fmt: skip
        self.pos_embed = param(
            rngs,
            kernel_init(c),
            (c.num_position_embeddings, c.hidden_size),
            (None, "embed"),
            c.storage_dtype,
        )
        self.blocks = nnx.List([QwenVisionBlock(c, rngs=rngs) for _ in range(c.depth)])
        self.merger = PatchMerger(c, rngs=rngs)

    def __call__(
        self,
        pixel_values: Float[ArrayLike, "N Q"],
        image_grid_thw: Int[ArrayLike, "I 3"],
    ) -> tuple[Float[Array, "L H"], Bool[Array, " L"]]:
        """The merged tokens of the images, one after the other, and which are real.

        Args:
          pixel_values: `[N, Q]` patches (`Q = in_channels * T * p**2`) of the images one
            after the other, as `tunelib.data.qwen_vl_image_inputs` returns them; rows past
            the images' patches are padding (any value).
          image_grid_thw: `[I, 3]` (frames, rows, columns) of patches of each image; rows and
            columns multiples of `spatial_merge_size`. It may be traced.

        Returns:
          `([L, H] tokens, [L] mask)` with `L = N // m**2` and `H = out_hidden_size`: image
          i's `t h w / m**2` tokens follow image i-1's; the mask is True on the images'.
        """
        c = self.config
        pixels = v.float_array(pixel_values, "pixel_values")
        grid = v.int_array(image_grid_thw, "image_grid_thw")
        if pixels.ndim != 2 or pixels.shape[-1] != c.patch_width:
            raise ValueError(
                f"pixel_values must have shape [N, {c.patch_width}] (in_channels x "
                f"temporal_patch_size x patch_size**2), got {pixels.shape}."
            )
        if grid.ndim != 2 or grid.shape[-1] != 3:
            raise ValueError(f"image_grid_thw must have shape [I, 3], got {grid.shape}.")
        window = c.spatial_merge_size**2
        if pixels.shape[0] % window:
            raise ValueError(
                f"pixel_values has {pixels.shape[0]} rows, not a multiple of "
                f"spatial_merge_size**2 = {window}."
            )
        rows, columns, heights, widths, segment = _patch_layout(
            grid, pixels.shape[0], c.spatial_merge_size
        )
        embedded = self._positions((rows, heights), (columns, widths))
        x = self.patch_embed(pixels) + jnp.where(segment[:, None] >= 0, embedded, 0)
        high = v.compute_dtype(c.compute_dtype)
        frequencies = rope_frequencies(c.head_dim // 2, theta=c.rope_theta)
        (cos_r, sin_r), (cos_c, sin_c) = (
            rope_angles(axis[None], frequencies, high) for axis in (rows, columns)
        )
        cos = jnp.concatenate([cos_r, cos_c], axis=-1)
        sin = jnp.concatenate([sin_r, sin_c], axis=-1)
        allowed = (segment[:, None] == segment[None, :])[None, None]
        x = x[None]
        for block in self.blocks:
            x = block(x, cos, sin, allowed)
        real = segment[::window] >= 0
        return self.merger(x[0]), real

    def _positions(self, *axes):
        """The learned positions resampled bilinearly (corners aligned) to each patch's image
        grid: `axes` are `(index, extent)` of its row and column, each `[N]`."""
        c = self.config
        side = math.isqrt(c.num_position_embeddings)
        taps, weights = [], []
        for index, extent in axes:
            source = index.astype(jnp.float32) * (side - 1) / jnp.maximum(extent - 1, 1)
            floor = jnp.floor(source)
            offsets = jnp.arange(2)
            taps.append(jnp.clip(floor.astype(jnp.int32)[:, None] + offsets, 0, side - 1))
            weights.append(jnp.maximum(1 - jnp.abs(source[:, None] - floor[:, None] - offsets), 0))
        index = (taps[0][:, :, None] * side + taps[1][:, None, :]).reshape(-1, 4)
        weight = (weights[0][:, :, None] * weights[1][:, None, :]).reshape(-1, 4)
        table = self.pos_embed[...].astype(jnp.float32)
        embedded = jnp.einsum("nk,nkc->nc", weight, jnp.take(table, index, axis=0))
        return embedded.astype(c.compute_dtype)


def _image_of(grid: jax.Array, n: int) -> jax.Array:
    """`[N]` the image each patch row belongs to (`I` past the last one)."""
    ends = jnp.cumsum(jnp.prod(grid, axis=-1))
    return jnp.searchsorted(ends, jnp.arange(n), side="right")


def _patch_layout(grid: jax.Array, n: int, merge: int) -> tuple[jax.Array, ...]:
    """`[N]` grid row, column, grid height and width and attention segment (a frame of an
    image, numbered over the images; -1 on padding) of each patch row, the patches of each
    frame laid out window by window (transformers' `get_vision_position_ids` and
    `get_vision_cu_seqlens`)."""
    grid = jnp.concatenate([grid, jnp.asarray([[0, merge, merge]], grid.dtype)])  # padding
    image = _image_of(grid[:-1], n)
    t, h, w = (jnp.take(grid[:, axis], image) for axis in range(3))
    patches = grid[:, 0] * grid[:, 1] * grid[:, 2]
    start = jnp.take(jnp.cumsum(patches) - patches, image)
    first_frame = jnp.take(jnp.cumsum(grid[:, 0]) - grid[:, 0], image)
    offset = jnp.arange(n) - start
    within = offset % (h * w)
    blocks_w = w // merge
    rows = (within // (merge * merge * blocks_w)) * merge + (within // merge) % merge
    columns = ((within // (merge * merge)) % blocks_w) * merge + within % merge
    segment = jnp.where(t > 0, first_frame + offset // (h * w), -1)
    return rows, columns, h, w, segment
