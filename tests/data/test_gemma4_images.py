"""Gemma 4's image preprocessing and soft-token layout, checked against transformers."""

import numpy as np
import pytest

from tests._helpers import raises_naming, random_image
from tests._hf import hf_modules, write_image_tokenizer
from tunelib.data import (
    HFTokenizer,
    encode_chat,
    expand_image_tokens,
    gemma4_image_inputs,
    gemma4_image_size,
)

# Small patches and the smallest budget transformers accepts keep the images small.
SETTINGS = [
    dict(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3),
    dict(patch_size=2, max_soft_tokens=140, pooling_kernel_size=2),
]
# (height, width): landscape, portrait, square, already the target size, upscaled, and thin
# images whose short side rounds to 0 (transformers' edge case).
SIZES = [(37, 53), (61, 23), (48, 48), (84, 84), (9, 14), (3, 250), (400, 5)]
# The special tokens of Gemma 4's tokenizer that its processor reads.
IMAGE_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}


def hf_image_processor(**kwargs):
    _, transformers = hf_modules()
    return transformers.Gemma4ImageProcessorPil(**kwargs)


@pytest.mark.parametrize("settings", SETTINGS)
def test_sizes_equal_transformers(settings):
    _, transformers = hf_modules()
    reference = transformers.models.gemma4.image_processing_pil_gemma4
    for height in (1, 2, 5, 17, 40, 99, 300, 1000):
        for width in (1, 3, 8, 31, 64, 250, 777):
            try:
                expected = reference.get_aspect_ratio_preserving_size(
                    height,
                    width,
                    settings["patch_size"],
                    settings["max_soft_tokens"] * settings["pooling_kernel_size"] ** 2,
                    settings["pooling_kernel_size"],
                )
            except ValueError:
                with pytest.raises(ValueError, match=f"{height}x{width}"):
                    gemma4_image_size(height, width, **settings)
                continue
            assert gemma4_image_size(height, width, **settings) == expected, (height, width)


@pytest.mark.parametrize("settings", SETTINGS)
def test_inputs_equal_the_pil_image_processor_bit_for_bit(settings):
    """Resize, rescale, patches, positions and soft-token counts, on images of several sizes
    and modes (grey and transparent images are converted to RGB first)."""
    rng = np.random.default_rng(0)
    modes = ["RGB", "L", "RGBA"]
    images = [random_image(rng, h, w, modes[i % 3]) for i, (h, w) in enumerate(SIZES)]
    expected = hf_image_processor(**settings)(images, return_tensors="np")
    ours = gemma4_image_inputs(images, **settings)
    assert set(ours) == set(expected)
    for key in ("pixel_values", "image_position_ids"):
        assert ours[key].dtype == expected[key].dtype, key
        np.testing.assert_array_equal(ours[key], expected[key], err_msg=key)
    assert ours["num_soft_tokens_per_image"] == list(expected["num_soft_tokens_per_image"])
    # Arrays give what their PIL images give.
    arrays = gemma4_image_inputs([np.asarray(image) for image in images], **settings)
    np.testing.assert_array_equal(arrays["pixel_values"], ours["pixel_values"])


def test_normalised_inputs_equal_transformers():
    rng = np.random.default_rng(1)
    images = [random_image(rng, 30, 41), random_image(rng, 52, 20)]
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.3, 0.25]
    settings = SETTINGS[0]
    expected = hf_image_processor(**settings, do_normalize=True, image_mean=mean, image_std=std)(
        images, return_tensors="np"
    )
    ours = gemma4_image_inputs(images, **settings, image_mean=mean, image_std=std)
    np.testing.assert_array_equal(ours["pixel_values"], expected["pixel_values"])


def test_patches_are_the_resized_image_in_row_major_order():
    """An image already of the target size is not resampled: patch (y, x) holds its
    pixels, flattened row by row with the channels last, over 255."""
    rng = np.random.default_rng(2)
    image = rng.integers(0, 256, (8, 12, 3), dtype=np.uint8)
    inputs = gemma4_image_inputs([image], patch_size=2, max_soft_tokens=6, pooling_kernel_size=2)
    patches, positions = inputs["pixel_values"][0], inputs["image_position_ids"][0]
    assert inputs["num_soft_tokens_per_image"] == [6]
    assert patches.shape == (24, 12) and positions.shape == (24, 2)
    for (x, y), patch in zip(positions, patches, strict=True):
        block = image[2 * y : 2 * y + 2, 2 * x : 2 * x + 2].astype(np.float64) / 255
        np.testing.assert_allclose(patch, block.reshape(-1), rtol=1e-7)
    assert positions[:, 1].tolist() == sorted(positions[:, 1].tolist())
    # A 4 x 4 image grows to 8 x 8 (16 patches, 4 soft tokens); the 8 rows of padding are
    # zero patches at (-1, -1).
    small = gemma4_image_inputs(
        [image[:4, :4]], patch_size=2, max_soft_tokens=6, pooling_kernel_size=2
    )
    assert small["num_soft_tokens_per_image"] == [4]
    assert not small["pixel_values"][0, 16:].any() and small["pixel_values"][0, :16].any()
    assert (small["image_position_ids"][0, 16:] == -1).all()
    assert small["image_position_ids"][0, :16].max() == 3
    none = gemma4_image_inputs([], patch_size=2, max_soft_tokens=6, pooling_kernel_size=2)
    assert none["pixel_values"].shape == (0, 24, 12) and none["num_soft_tokens_per_image"] == []


def test_bad_arguments_are_named():
    image = np.zeros((8, 8, 3), np.uint8)
    with raises_naming("resample", "bicubic"):
        gemma4_image_inputs([image], resample="cubic")
    with raises_naming("image_mean", "image_std"):
        gemma4_image_inputs([image], image_mean=[0.5, 0.5, 0.5])
    with raises_naming("float32"):
        gemma4_image_inputs([image.astype(np.float32)])
    with raises_naming("patch_size"):
        gemma4_image_size(8, 8, patch_size=0)


@pytest.fixture(scope="module")
def image_tokenizer_directory(tmp_path_factory):
    return write_image_tokenizer(
        tmp_path_factory.mktemp("gemma4_tokenizer"), IMAGE_TOKENS, IMAGE_TOKENS["image_token"]
    )


def gemma4_processor(directory, image_processor):
    """transformers' `Gemma4Processor` on the test tokenizer. Its class checks are skipped:
    the video processor it insists on needs torchvision, and the text is all it expands."""
    _, transformers = hf_modules()

    class Processor(transformers.Gemma4Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return Processor(
        feature_extractor=None,
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
    )


def test_chat_with_images_gives_the_processors_token_ids(image_tokenizer_directory):
    settings = SETTINGS[0]
    processor = gemma4_processor(image_tokenizer_directory, hf_image_processor(**settings))
    tok = HFTokenizer.from_directory(image_tokenizer_directory)
    rng = np.random.default_rng(3)
    images = [random_image(rng, 30, 50), random_image(rng, 60, 21), random_image(rng, 9, 9)]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "what is 12 + 7? "},
                {"type": "image"},
            ],
        },
        {"role": "assistant", "content": "the answer is 19."},
        {"role": "user", "content": [{"type": "text", "text": "and?"}, {"type": "image"}]},
        {"role": "assistant", "content": "fine, thank you!"},
    ]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False)
    expected = processor(text=[text], images=[images])["input_ids"][0]

    ids, where = encode_chat(tok, messages)
    inputs = gemma4_image_inputs(images, **settings)
    image_ids = {
        name: tok.encode(token)[0]
        for name, token in (
            ("image_token_id", "<|image|>"),
            ("boi_token_id", "<|image>"),
            ("eoi_token_id", "<image|>"),
        )
    }
    expanded, expanded_where = expand_image_tokens(
        ids, inputs["num_soft_tokens_per_image"], **image_ids, where=where
    )
    assert len(set(inputs["num_soft_tokens_per_image"])) == 3
    assert expanded.tolist() == list(expected)
    # The assistant turns keep their mask; the image tokens, in user turns, are not learnt.
    assert expanded_where.sum() == where.sum()
    assert not expanded_where[expanded == image_ids["image_token_id"]].any()
