"""Qwen3.5's multimodal RoPE: 3-D positions of image and text tokens and their rotary angles."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Int

from tunelib import _validation as v
from tunelib._typing import Mask


def mrope_axes(section: tuple[int, int, int], pairs: int) -> np.ndarray:
    """`[pairs]` the position axis (0 temporal, 1 height, 2 width) each rotary pair turns by,
    in transformers' interleaved layout: pair `i` takes axis 1 where `i % 3 == 1` and
    `i < 3 * section[1]`, axis 2 where `i % 3 == 2` and `i < 3 * section[2]`, else 0."""
    axes = np.zeros(pairs, np.int64)
    for axis in (1, 2):
        axes[axis : min(3 * section[axis], pairs) : 3] = axis
    return axes


def mrope_angles(
    positions: jax.Array, frequencies: np.ndarray, axes: np.ndarray, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """`cos` and `sin` `[B, T, D/2]` of pair `i` turned by `positions[axes[i]] * frequencies[i]`
    for `[3, B, T]` positions."""
    per_pair = jnp.moveaxis(jnp.take(positions, jnp.asarray(axes), axis=0), 0, -1)
    angles = per_pair.astype(dtype) * jnp.asarray(frequencies, dtype)
    return jnp.cos(angles), jnp.sin(angles)


def mrope_positions(
    tokens: Int[ArrayLike, "B T"],
    where: Mask[ArrayLike, "B T"] | None,
    image_grid_thw: Int[ArrayLike, "I 3"],
    *,
    image_token_id: int,
    spatial_merge_size: int,
) -> tuple[Int[Array, "3 B T"], Int[Array, " B"]]:
    r"""Qwen3.5's 3-D RoPE positions of a batch of image+text prompts, and each row's delta.

    Along a row's real tokens a counter $c$ starts at 0. A text token takes $(c, c, c)$ and
    adds 1. A run of image tokens is the next image of the batch (images numbered row by row,
    in order), its $t \cdot g_h \cdot g_w$ tokens with $g_h = h / m$, $g_w = w / m$ for its
    grid $(t, h, w)$ and $m$ = `spatial_merge_size`; its $k$-th token, frame $f$, merged
    row $r$ and column $q$ ($k = (f g_h + r) g_w + q$), takes $(c + f, c + r, c + q)$, and
    the run adds $\max(g_h, g_w)$. The delta of a row is one past its largest position minus
    its real tokens: a token decoded after $n$ real tokens of the row has position
    $n + \delta$ on every axis. Padding takes 0. Runs of image tokens are separated by other
    tokens (the template's `<|vision_start|>` and `<|vision_end|>`).

    Args:
      tokens: `[B, T]` token ids, each image's `<|image_pad|>` repeated once per merged
        token (`tunelib.data.expand_image_tokens`).
      where: `[B, T]` True on real tokens; None: all real.
      image_grid_thw: `[I, 3]` patch grids of the batch's images, in the order their tokens
        appear (`tunelib.data.qwen_vl_image_inputs`); `I` may be 0.
      image_token_id: the image token.
      spatial_merge_size: $m$.

    Returns:
      `([3, B, T] int32 positions, [B] int32 deltas)`.

    References:
      transformers 5.25, `models/qwen3_5/modeling_qwen3_5.py`, `Qwen3_5Model.get_rope_index`.

    Examples:
      >>> import numpy as np
      >>> from tunelib.models import mrope_positions
      >>> tokens = np.array([[1, 7, 9, 9, 9, 9, 9, 9, 8, 2]])  # one image of 2 x 3 tokens
      >>> positions, delta = mrope_positions(
      ...     tokens, None, np.array([[1, 4, 6]]), image_token_id=9, spatial_merge_size=2)
      >>> for axis in positions[:, 0].tolist():
      ...     print(axis)
      [0, 1, 2, 2, 2, 2, 2, 2, 5, 6]
      [0, 1, 2, 2, 2, 3, 3, 3, 5, 6]
      [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]
      >>> delta.tolist()
      [-3]
    """
    tokens = v.int_array(tokens, "tokens")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape [B, T], got {tokens.shape}.")
    where = v.mask_array(where, tokens.shape, "where")
    grid = v.int_array(image_grid_thw, "image_grid_thw").reshape(-1, 3)
    v.static_int(spatial_merge_size, "spatial_merge_size")
    image = (tokens == image_token_id) & where
    before = jnp.pad(image[:, :-1], ((0, 0), (1, 0)))
    starts = image & ~before
    number = (jnp.cumsum(starts.reshape(-1)) - 1).reshape(tokens.shape)
    grid = jnp.concatenate([grid, jnp.ones((1, 3), grid.dtype)])  # past the last image
    number = jnp.clip(number, 0, grid.shape[0] - 1)
    rows = jnp.maximum(jnp.take(grid[:, 1], number) // spatial_merge_size, 1)
    columns = jnp.maximum(jnp.take(grid[:, 2], number) // spatial_merge_size, 1)
    rank = jnp.cumsum(image, axis=1) - 1  # image tokens before, in the row
    first = jax.lax.cummax(jnp.where(starts, rank, -1), axis=1)
    k = rank - first
    after = jnp.pad(image[:, 1:], ((0, 0), (0, 1)))
    last = image & ~after
    step = jnp.where(image, jnp.where(last, jnp.maximum(rows, columns), 0), where)
    counter = jnp.cumsum(step, axis=1) - step
    offsets = jnp.stack([k // (rows * columns), (k // columns) % rows, k % columns]) * image.astype(
        k.dtype
    )
    positions = jnp.where(where, counter + offsets, 0).astype(jnp.int32)
    top = jnp.max(jnp.where(where, positions.max(0), -1), axis=1)
    delta = (top + 1 - where.sum(axis=1)).astype(jnp.int32)
    return positions, delta
