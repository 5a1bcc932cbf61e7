"""Image markers in a prompt expanded into the soft tokens their images become."""

from collections.abc import Sequence

import numpy as np
from jaxtyping import Bool, Int, Shaped


def expand_image_tokens(
    ids: Sequence[int] | Int[np.ndarray, " T"],
    num_soft_tokens: Sequence[int],
    *,
    image_token_id: int,
    boi_token_id: int | None = None,
    eoi_token_id: int | None = None,
    where: Sequence[int] | Shaped[np.ndarray, " T"] | None = None,
) -> tuple[Int[np.ndarray, " N"], Bool[np.ndarray, " N"] | None]:
    r"""A prompt's image markers expanded into the soft-token layout of its images.

    $$
    \langle\mathrm{image}\rangle_i \;\mapsto\;
    \mathrm{BOI}\ \underbrace{\langle\mathrm{image}\rangle \cdots
    \langle\mathrm{image}\rangle}_{n_i}\ \mathrm{EOI}
    $$

    The $i$-th `image_token_id` of `ids` (the marker the chat template writes for an image)
    becomes `boi_token_id`, $n_i$ = `num_soft_tokens[i]` copies of `image_token_id` (the
    positions the vision encoder's soft tokens fill) and `eoi_token_id`: Gemma 4's layout,
    as `Gemma4Processor` expands the image token in the text before tokenizing it. Without
    `boi_token_id` and `eoi_token_id` the marker becomes its $n_i$ copies alone: Qwen3.5's
    layout (`Qwen3VLProcessor` repeats `<|image_pad|>`; the chat template writes the
    `<|vision_start|>` and `<|vision_end|>` around it).

    Args:
      ids: `[T]` token ids with one `image_token_id` per image.
      num_soft_tokens: $n_i$ per image in order, from `gemma4_image_inputs` or
        `qwen_vl_image_inputs`.
      image_token_id: the image token (Gemma 4's `<|image|>`, Qwen's `<|image_pad|>`; the
        config's `image_token_id`).
      boi_token_id: the begin-of-image token (Gemma 4's config `boi_token_id`), or None.
      eoi_token_id: the end-of-image token (Gemma 4's config `eoi_token_id`), or None.
      where: None, or a `[T]` mask (bool, or 0 and 1; say, the completion mask) whose
        value at a marker is given to every token that marker becomes.

    Returns:
      `(ids, where)`: the expanded int32 ids (`sum(n_i + 1)` longer with both begin and end
      tokens) and the expanded bool mask (None when `where` is None).

    Raises:
      ValueError: when the number of markers differs from `len(num_soft_tokens)`, or
        `where` does not have the shape of `ids`.

    References:
      transformers 5.25, `models/gemma4/processing_gemma4.py`,
      `Gemma4Processor.replace_image_token`; `models/qwen3_vl/processing_qwen3_vl.py`,
      `Qwen3VLProcessor.replace_image_token`.

    Examples:
      >>> from tunelib.data import expand_image_tokens
      >>> ids, where = expand_image_tokens(
      ...     [5, 9, 6, 9], [2, 1], image_token_id=9, boi_token_id=7, eoi_token_id=8,
      ...     where=[False, False, True, True],
      ... )
      >>> ids.tolist()
      [5, 7, 9, 9, 8, 6, 7, 9, 8]
      >>> where.astype(int).tolist()
      [0, 0, 0, 0, 0, 1, 1, 1, 1]
      >>> expand_image_tokens([5, 9, 6], [3], image_token_id=9)[0].tolist()
      [5, 9, 9, 9, 6]
    """
    ids = np.asarray(ids, np.int32)
    markers = np.flatnonzero(ids == image_token_id)
    if len(markers) != len(num_soft_tokens):
        raise ValueError(
            f"ids hold {len(markers)} image tokens ({image_token_id}) but num_soft_tokens has "
            f"{len(num_soft_tokens)} entries, one per image."
        )
    repeats = np.ones(len(ids), np.int64)
    wrap = (boi_token_id is not None) + (eoi_token_id is not None)
    repeats[markers] = np.asarray(num_soft_tokens, np.int64) + wrap
    expanded = np.repeat(ids, repeats)
    starts = np.cumsum(repeats) - repeats
    if boi_token_id is not None:
        expanded[starts[markers]] = boi_token_id
    if eoi_token_id is not None:
        expanded[starts[markers] + repeats[markers] - 1] = eoi_token_id
    if where is None:
        return expanded, None
    where = np.asarray(where)
    if where.dtype != bool and not np.isin(where, (0, 1)).all():
        raise ValueError("where must be a bool mask or hold only 0 and 1.")
    if where.shape != ids.shape:
        raise ValueError(
            f"where must have the shape of ids {list(ids.shape)}, got {list(where.shape)}."
        )
    return expanded, np.repeat(where.astype(bool), repeats)
