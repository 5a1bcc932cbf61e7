"""Qwen3.5's image preprocessing (Qwen2-VL's): smart resize, temporal and spatial patches."""

import math
import os
from collections.abc import Sequence
from typing import Any

import einops
import numpy as np

from tunelib.data._images import ImageSource, check_pixel_options, load_image, resized_pixels

# transformers' `OPENAI_CLIP_MEAN` and `OPENAI_CLIP_STD`, Qwen2VLImageProcessorPil's defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def qwen_vl_image_size(
    height: int,
    width: int,
    *,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    r"""Qwen-VL's smart resize: sides that are multiples of `factor`, the pixel count in range.

    $$
    (h', w') = \begin{cases}
    \big(\max(F, F \lfloor h / \beta F \rfloor), \max(F, F \lfloor w / \beta F \rfloor)\big),
      \ \beta = \sqrt{h w / P_{\max}} & \text{if } \bar h \bar w > P_{\max} \\
    \big(F \lceil h \beta / F \rceil, F \lceil w \beta / F \rceil\big),
      \ \beta = \sqrt{P_{\min} / h w} & \text{if } \bar h \bar w < P_{\min} \\
    (\bar h, \bar w) = (F\,\mathrm{round}(h / F), F\,\mathrm{round}(w / F)) & \text{otherwise}
    \end{cases}
    $$

    with $h, w$ = `height`, `width`, $F$ = `factor` (`patch_size * merge_size`),
    $P_{\min}$ = `min_pixels`, $P_{\max}$ = `max_pixels`; `round` is Python's (halves to
    even), as in transformers.

    Args:
      height: the image's height in pixels, >= 1.
      width: the image's width in pixels, >= 1.
      factor: $F$, the side of a merged patch in pixels.
      min_pixels: $P_{\min}$ (a processor's `size["shortest_edge"]`).
      max_pixels: $P_{\max}$ (a processor's `size["longest_edge"]`).

    Returns:
      `(h', w')`, multiples of `factor`.

    Raises:
      ValueError: for an aspect ratio above 200, as transformers refuses it.

    References:
      transformers 5.25, `models/qwen2_vl/image_processing_pil_qwen2_vl.py`, `smart_resize`.

    Examples:
      >>> from tunelib.data import qwen_vl_image_size
      >>> qwen_vl_image_size(480, 640)
      (476, 644)
      >>> qwen_vl_image_size(20, 30, factor=8, min_pixels=32 * 32, max_pixels=64 * 64)
      (32, 40)
    """
    if min(height, width) < 1:
        raise ValueError(f"height and width must be >= 1, got {height}x{width}.")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"a {height}x{width} image has an aspect ratio above 200, which Qwen-VL refuses."
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_vl_image_inputs(
    images: Sequence[ImageSource],
    *,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
    resample: str = "bicubic",
    rescale_factor: float = 1 / 255,
    image_mean: Sequence[float] | None = CLIP_MEAN,
    image_std: Sequence[float] | None = CLIP_STD,
    root: str | os.PathLike | None = None,
) -> dict[str, Any]:
    r"""Qwen3.5's vision inputs (Qwen2-VL's image processor): resized, normalised patches.

    Each image, converted to RGB (`load_image`), is resized by PIL to `qwen_vl_image_size`
    with $F$ = `patch_size * merge_size`, rescaled and normalised per channel $c$,

    $$
    x = \frac{r \cdot v - \mu_c}{\sigma_c},
    $$

    then cut into a grid of $g_h \times g_w$ patches of $p \times p$ pixels ($g_h = h' / p$,
    $g_w = w' / p$), ordered window by window: the $m \times m$ patches that the vision
    encoder merges into one token are consecutive (row-major inside the window, windows
    row-major). Each patch is flattened channel-major as `[C, T, p, p]`, the single image
    frame repeated $T$ = `temporal_patch_size` times (a still image is a video of $T$ equal
    frames). An image gives $g_h g_w$ rows and $g_h g_w / m^2$ tokens in the prompt, where
    the chat template's `<|image_pad|>` is repeated that many times
    (`expand_image_tokens` without begin and end tokens: the template writes
    `<|vision_start|>` and `<|vision_end|>` itself).

    The defaults are transformers' `Qwen2VLImageProcessorPil`'s; a checkpoint's
    `preprocessor_config.json` sets its own (Qwen3.5's patches are 16 pixels, its mean and
    std 0.5).

    Args:
      images: the images, as `load_image` takes them.
      patch_size: $p$.
      temporal_patch_size: $T$.
      merge_size: $m$, the side of the window of patches merged into one token.
      min_pixels: the fewest pixels of a resized image.
      max_pixels: the most pixels of a resized image.
      resample: PIL's filter ("bicubic", Qwen's).
      rescale_factor: $r$.
      image_mean: $\mu$ per channel, or None (with `image_std`) for no normalisation.
      image_std: $\sigma$ per channel, or None.
      root: the folder relative image paths are read from.

    Returns:
      A dict with transformers' keys and one more:

      * `"pixel_values"`: float32 `[sum of g_h g_w, 3 * T * p * p]`, the images' patches
        one after the other;
      * `"image_grid_thw"`: int64 `[num_images, 3]`, $(1, g_h, g_w)$ per image;
      * `"num_soft_tokens_per_image"`: a list of ints, $g_h g_w / m^2$ per image (what
        transformers' processor computes from the grid).

      Values equal `Qwen2VLImageProcessorPil`'s bit for bit.

    References:
      transformers 5.25, `models/qwen2_vl/image_processing_pil_qwen2_vl.py`,
      `Qwen2VLImageProcessorPil`; `models/qwen3_vl/processing_qwen3_vl.py`.

    Examples:
      >>> import numpy as np
      >>> from tunelib.data import qwen_vl_image_inputs
      >>> image = np.zeros((20, 30, 3), np.uint8)
      >>> inputs = qwen_vl_image_inputs(
      ...     [image], patch_size=4, merge_size=2, min_pixels=32 * 32, max_pixels=64 * 64
      ... )
      >>> inputs["pixel_values"].shape, inputs["image_grid_thw"].tolist()
      ((80, 96), [[1, 8, 10]])
      >>> inputs["num_soft_tokens_per_image"]
      [20]
    """
    check_pixel_options(resample, image_mean, image_std)
    patches, grids = [], []
    for source in images:
        image = load_image(source, root=root)
        size = qwen_vl_image_size(
            *image.shape[:2],
            factor=patch_size * merge_size,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )
        pixels = resized_pixels(
            image,
            size,
            resample=resample,
            rescale_factor=rescale_factor,
            image_mean=image_mean,
            image_std=image_std,
        )
        windows = einops.rearrange(
            pixels,
            "(gy my py) (gx mx px) c -> (gy gx my mx) c py px",
            my=merge_size,
            mx=merge_size,
            py=patch_size,
            px=patch_size,
        )
        patches.append(einops.repeat(windows, "n c py px -> n (c t py px)", t=temporal_patch_size))
        grids.append((1, size[0] // patch_size, size[1] // patch_size))
    width = 3 * temporal_patch_size * patch_size**2
    grid = np.asarray(grids, np.int64).reshape(len(grids), 3)
    return {
        "pixel_values": np.concatenate(patches) if patches else np.zeros((0, width), np.float32),
        "image_grid_thw": grid,
        "num_soft_tokens_per_image": [int(g.prod()) // merge_size**2 for g in grid],
    }
