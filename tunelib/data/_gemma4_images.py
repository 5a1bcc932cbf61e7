"""Gemma 4's image preprocessing and the soft-token layout of its images in the prompt."""

import math
import os
from collections.abc import Sequence
from typing import Any

import einops
import numpy as np

from tunelib.data._images import (
    ImageSource,
    check_pixel_options,
    load_image,
    resized_pixels,
)


def gemma4_image_size(
    height: int,
    width: int,
    *,
    patch_size: int = 16,
    max_soft_tokens: int = 280,
    pooling_kernel_size: int = 3,
) -> tuple[int, int]:
    r"""The size Gemma 4 resizes an image to: its aspect ratio kept, within the patch budget.

    $$
    f = \sqrt{\frac{N p^2}{h w}}, \qquad
    h' = m \left\lfloor \frac{f h}{m} \right\rfloor, \qquad
    w' = m \left\lfloor \frac{f w}{m} \right\rfloor, \qquad m = k p, \quad N = S k^2
    $$

    with $h, w$ = `height`, `width`, $p$ = `patch_size`, $k$ = `pooling_kernel_size` and
    $S$ = `max_soft_tokens`: the largest sides that are multiples of $k p$ (whole pooling
    windows of whole patches) with at most $N$ patches. A side that rounds to 0 (a very
    long, thin image) becomes $m$, and the other $\min(m \lfloor w / h \rfloor, m S)$ (or
    with $h / w$), as transformers computes it.

    Args:
      height: the image's height in pixels, >= 1.
      width: the image's width in pixels, >= 1.
      patch_size: $p$, the side of a square patch in pixels.
      max_soft_tokens: $S$, the most soft tokens an image becomes after pooling.
      pooling_kernel_size: $k$, the side of the pooling window in patches.

    Returns:
      `(h', w')`, both multiples of `pooling_kernel_size * patch_size`.

    Raises:
      ValueError: for an image both of whose sides round to 0, or whose resized size would
        exceed the budget, naming both sizes.

    References:
      transformers 5.25, `models/gemma4/image_processing_pil_gemma4.py`,
      `get_aspect_ratio_preserving_size`.

    Examples:
      >>> from tunelib.data import gemma4_image_size
      >>> gemma4_image_size(480, 640)  # 280 soft tokens of 3x3 patches of 16 pixels
      (672, 912)
      >>> gemma4_image_size(8, 12, patch_size=2, max_soft_tokens=4, pooling_kernel_size=2)
      (4, 8)
    """
    for name, value in (
        ("height", height),
        ("width", width),
        ("patch_size", patch_size),
        ("max_soft_tokens", max_soft_tokens),
        ("pooling_kernel_size", pooling_kernel_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")
    max_patches = max_soft_tokens * pooling_kernel_size**2
    target_pixels = max_patches * patch_size**2
    factor = math.sqrt(target_pixels / (height * width))
    side = pooling_kernel_size * patch_size
    target_height = math.floor(factor * height / side) * side
    target_width = math.floor(factor * width / side) * side
    if target_height == 0 and target_width == 0:
        raise ValueError(
            f"a {height}x{width} image resizes to 0x0: both sides round to 0 in multiples of "
            f"pooling_kernel_size * patch_size = {side}."
        )
    longest = (max_patches // pooling_kernel_size**2) * side
    if target_height == 0:
        target_height = side
        target_width = min(math.floor(width / height) * side, longest)
    elif target_width == 0:
        target_width = side
        target_height = min(math.floor(height / width) * side, longest)
    if target_height * target_width > target_pixels:
        raise ValueError(
            f"a {height}x{width} image would resize to {target_height}x{target_width}, more "
            f"than {max_patches} patches of {patch_size}x{patch_size} pixels."
        )
    return target_height, target_width


def gemma4_image_inputs(
    images: Sequence[ImageSource],
    *,
    patch_size: int = 16,
    max_soft_tokens: int = 280,
    pooling_kernel_size: int = 3,
    resample: str = "bicubic",
    rescale_factor: float = 1 / 255,
    image_mean: Sequence[float] | None = None,
    image_std: Sequence[float] | None = None,
    root: str | os.PathLike | None = None,
) -> dict[str, Any]:
    r"""Gemma 4's vision inputs: images resized, rescaled, cut into patches, with positions.

    Each image, converted to RGB (`load_image`), is resized to `gemma4_image_size` by PIL
    (bicubic; not at all when it already has that size), then rescaled and, when `image_mean`
    and `image_std` are given, normalised per channel $c$:

    $$
    x = \frac{r \cdot v - \mu_c}{\sigma_c}
    $$

    with $v$ the pixel value 0..255, $r$ = `rescale_factor` ($r v$ in float64, then float32,
    as transformers rescales), $\mu$ = `image_mean`, $\sigma$ = `image_std` (Gemma 4's
    checkpoints use none: pixels in [0, 1]). The image `[h', w', 3]` is cut into
    `P = (h'/p) (w'/p)` patches in row-major order, each flattened row by row with the
    channels last (`[p * p * 3]`), and patch $i$ at row $y$, column $x$ of the grid gets the
    position $(x, y)$. Patches and positions are padded to the budget `N = S k^2` rows with
    zeros and $(-1, -1)$. The vision encoder pools $k \times k$ patches into a soft token, so
    an image becomes `P // k**2` soft tokens in the prompt (`expand_image_tokens`).

    Args:
      images: the images, as `load_image` takes them (paths, PIL images, uint8 arrays).
      patch_size: $p$.
      max_soft_tokens: $S$. (transformers' processor accepts only 70, 140, 280, 560 and 1120;
        any positive value works here, for small test models.)
      pooling_kernel_size: $k$.
      resample: PIL's filter: "bicubic" (Gemma 4's), "bilinear", "lanczos", "nearest",
        "box" or "hamming".
      rescale_factor: $r$.
      image_mean: $\mu$ per channel, or None for no normalisation (needs `image_std`).
      image_std: $\sigma$ per channel, or None.
      root: the folder relative image paths are read from.

    Returns:
      A dict with transformers' keys:

      * `"pixel_values"`: float32 `[num_images, N, p * p * 3]`;
      * `"image_position_ids"`: int64 `[num_images, N, 2]`, (x, y) per patch, -1 on padding;
      * `"num_soft_tokens_per_image"`: a list of ints, `P // k**2` per image.

      Values equal `Gemma4ImageProcessorPil`'s bit for bit (the same PIL resize and the same
      float arithmetic).

    Raises:
      ValueError: for a bad image (`ImageError`), an unknown `resample`, only one of
        `image_mean` and `image_std`, or sizes as `gemma4_image_size` raises them.

    References:
      transformers 5.25, `models/gemma4/image_processing_pil_gemma4.py`,
      `Gemma4ImageProcessorPil`.

    Examples:
      >>> import numpy as np
      >>> from tunelib.data import gemma4_image_inputs
      >>> image = np.arange(8 * 12 * 3, dtype=np.uint8).reshape(8, 12, 3)
      >>> inputs = gemma4_image_inputs(
      ...     [image], patch_size=2, max_soft_tokens=4, pooling_kernel_size=2
      ... )
      >>> inputs["pixel_values"].shape, inputs["num_soft_tokens_per_image"]
      ((1, 16, 12), [2])
      >>> inputs["image_position_ids"][0, :10].tolist()
      [[0, 0], [1, 0], [2, 0], [3, 0], [0, 1], [1, 1], [2, 1], [3, 1], [-1, -1], [-1, -1]]
    """
    check_pixel_options(resample, image_mean, image_std)
    images = list(images)
    max_patches = max_soft_tokens * pooling_kernel_size**2
    pixel_values = np.zeros((len(images), max_patches, patch_size * patch_size * 3), np.float32)
    position_ids = np.full((len(images), max_patches, 2), -1, np.int64)
    num_soft_tokens = []
    for i, source in enumerate(images):
        image = load_image(source, root=root)
        size = gemma4_image_size(
            *image.shape[:2],
            patch_size=patch_size,
            max_soft_tokens=max_soft_tokens,
            pooling_kernel_size=pooling_kernel_size,
        )
        pixels = resized_pixels(
            image,
            size,
            resample=resample,
            rescale_factor=rescale_factor,
            image_mean=image_mean,
            image_std=image_std,
        )
        patches = einops.rearrange(
            pixels, "(y p) (x q) c -> (y x) (p q c)", p=patch_size, q=patch_size
        )
        x, y = np.meshgrid(np.arange(size[1] // patch_size), np.arange(size[0] // patch_size))
        pixel_values[i, : len(patches)] = patches
        position_ids[i, : len(patches)] = np.stack([x.ravel(), y.ravel()], axis=-1)
        num_soft_tokens.append(len(patches) // pooling_kernel_size**2)
    return {
        "pixel_values": pixel_values,
        "image_position_ids": position_ids,
        "num_soft_tokens_per_image": num_soft_tokens,
    }
