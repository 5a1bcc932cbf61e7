"""Images as the data pipelines take them: decoded, checked and converted to RGB arrays."""

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
from jaxtyping import UInt8

# The modes whose pixels are 8-bit values that convert to RGB without loss of meaning
# (bilevel, grey, palette and colour, with or without alpha). 16- and 32-bit integer and
# float modes ("I;16", "I", "F") would be clipped by the conversion, so they are refused.
IMAGE_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr")
RESAMPLING = {
    "nearest": PIL.Image.Resampling.NEAREST,
    "box": PIL.Image.Resampling.BOX,
    "bilinear": PIL.Image.Resampling.BILINEAR,
    "hamming": PIL.Image.Resampling.HAMMING,
    "bicubic": PIL.Image.Resampling.BICUBIC,
    "lanczos": PIL.Image.Resampling.LANCZOS,
}
# A source of an image: a path, a decoded PIL image, an array, or Hugging Face datasets'
# Parquet encoding of an image column (`{"bytes": ..., "path": ...}`).
ImageSource = Any


class ImageError(ValueError):
    """An image that cannot be used: the message says which and why.

    Attributes:
      reason: `"missing_image"` (no such file), `"undecodable_image"` (not an image file),
        or `"bad_image"` (a wrong mode, dtype or shape, or no pixels).
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _open(source: Any, root: Path | None) -> PIL.Image.Image:
    """The decoded PIL image of a path or of `{"bytes", "path"}`."""
    if isinstance(source, dict):
        data = source.get("bytes")
        if data is None:
            if source.get("path") is None:
                raise ImageError("bad_image", "the image dict has neither 'bytes' nor 'path'")
            return _open(source["path"], root)
        buffer, name = io.BytesIO(data), "the image bytes"
    else:
        path = Path(source)
        if root is not None and not path.is_absolute():
            path = root / path
        if not path.is_file():
            raise ImageError("missing_image", f"no image file {path}")
        # Read whole, so that no file stays open when decoding fails part way.
        buffer, name = io.BytesIO(path.read_bytes()), str(path)
    try:
        image = PIL.Image.open(buffer)
        image.load()
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError) as error:
        raise ImageError("undecodable_image", f"{name} is not a readable image ({error})") from None
    return image


def _check_pil(image: PIL.Image.Image) -> None:
    if image.mode not in IMAGE_MODES:
        raise ImageError(
            "bad_image",
            f"the image has mode {image.mode!r}; expected 8-bit pixels, one of {IMAGE_MODES}",
        )
    if image.width == 0 or image.height == 0:
        raise ImageError("bad_image", f"the image is {image.width}x{image.height}, no pixels")


def _check_array(image: np.ndarray) -> None:
    if image.dtype != np.uint8:
        raise ImageError(
            "bad_image", f"an image array must be uint8 (values 0..255), got {image.dtype}"
        )
    if image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[-1] not in (1, 3, 4)):
        raise ImageError(
            "bad_image",
            f"an image array must be [H, W] or [H, W, C] with C in (1, 3, 4), got shape "
            f"{list(image.shape)}",
        )
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise ImageError("bad_image", f"the image array has shape {list(image.shape)}, no pixels")


def _rgb_of_pil(image: PIL.Image.Image) -> np.ndarray:
    """transformers' `convert_to_rgb`: transparency composited onto white, then RGB."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        white = PIL.Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = PIL.Image.alpha_composite(white, image)
    return np.asarray(image.convert("RGB"))


def _rgb_of_array(image: np.ndarray) -> np.ndarray:
    if image.ndim == 2:
        image = image[..., None]
    if image.shape[-1] == 1:
        return np.repeat(image, 3, axis=-1)
    if image.shape[-1] == 4:
        alpha = image[..., 3:] / 255
        return np.round(alpha * image[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return image


def load_image(
    source: ImageSource, *, root: str | os.PathLike | None = None
) -> UInt8[np.ndarray, "H W 3"]:
    r"""An image as an RGB array `[H, W, 3]` of uint8, decoded and checked.

    Conversion to RGB is transformers' (`convert_to_rgb`, which its image processors apply
    first): an image with transparency is composited onto white,

    $$
    \mathrm{rgb} = \mathrm{round}\big(\alpha \cdot c + (1 - \alpha) \cdot 255\big),
    \qquad \alpha = a / 255,
    $$

    with $c$ the colour and $a$ the alpha channel (PIL's `alpha_composite` for decoded
    images); grey images repeat their channel three times; palette, bilevel and CMYK images
    convert as PIL converts them.

    Args:
      source: a path to an image file (PNG, JPEG, ... anything PIL decodes), relative to
        `root` when not absolute; a PIL image; a uint8 array `[H, W]` or `[H, W, C]` with C
        in (1, 3, 4); or a `{"bytes": ..., "path": ...}` dict, the form Hugging Face datasets
        gives an image column in Parquet (the bytes are decoded; without them, the path is
        read).
      root: the folder relative paths are read from (for records, the data file's folder).

    Returns:
      A new or shared (for an RGB array) uint8 array `[H, W, 3]`.

    Raises:
      ImageError: a `ValueError` with `reason` `"missing_image"` for a path that is not a
        file, `"undecodable_image"` for a file PIL cannot decode (also a truncated one), or
        `"bad_image"` for a mode other than `IMAGE_MODES` (16-bit, 32-bit or float pixels),
        an array that is not uint8 or not an image's shape, or an image with no pixels.

    Examples:
      >>> import numpy as np
      >>> from tunelib.data import load_image
      >>> grey = np.array([[0, 255]], np.uint8)
      >>> load_image(grey).tolist()
      [[[0, 0, 0], [255, 255, 255]]]
      >>> half_transparent_black = np.array([[[0, 0, 0, 128]]], np.uint8)
      >>> load_image(half_transparent_black).tolist()
      [[[127, 127, 127]]]
      >>> try:
      ...     load_image("no/such.png", root="/data")
      ... except ValueError as error:
      ...     print(error)
      no image file /data/no/such.png
    """
    if isinstance(source, PIL.Image.Image):
        _check_pil(source)
        return _rgb_of_pil(source)
    if isinstance(source, np.ndarray):
        _check_array(source)
        return _rgb_of_array(source)
    if not isinstance(source, (str, os.PathLike, dict)):
        raise ImageError(
            "bad_image",
            "an image must be a path, a PIL image, a uint8 array or a {'bytes', 'path'} dict, "
            f"got {type(source).__name__}",
        )
    image = _open(source, None if root is None else Path(root))
    _check_pil(image)
    return _rgb_of_pil(image)


def check_pixel_options(
    resample: str, image_mean: Sequence[float] | None, image_std: Sequence[float] | None
) -> None:
    if resample not in RESAMPLING:
        raise ValueError(f"resample must be one of {tuple(RESAMPLING)}, got {resample!r}.")
    if (image_mean is None) != (image_std is None):
        raise ValueError("image_mean and image_std go together: give both or neither.")


def resized_pixels(
    image: np.ndarray,
    size: tuple[int, int],
    *,
    resample: str,
    rescale_factor: float,
    image_mean: Sequence[float] | None,
    image_std: Sequence[float] | None,
) -> np.ndarray:
    """An RGB uint8 image `[H, W, 3]` resized by PIL to `size` (height, width), rescaled
    (in float64, then float32) and normalised per channel when `image_mean` is given, as
    transformers' PIL image processors do: float32 `[*size, 3]`."""
    if image.shape[:2] != size:
        picture = PIL.Image.fromarray(image).resize((size[1], size[0]), RESAMPLING[resample])
        image = np.asarray(picture)
    pixels = (image.astype(np.float64) * rescale_factor).astype(np.float32)
    if image_mean is None:
        return pixels
    return (pixels - np.asarray(image_mean, np.float32)) / np.asarray(image_std, np.float32)
