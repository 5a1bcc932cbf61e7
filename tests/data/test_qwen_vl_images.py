"""Qwen3.5's (Qwen2-VL's) image preprocessing and soft tokens, checked against transformers."""

import numpy as np
import pytest

from tests._helpers import raises_naming, random_image
from tests._hf import hf_modules, write_image_tokenizer
from tunelib.data import (
    HFTokenizer,
    encode_chat,
    expand_image_tokens,
    qwen_vl_image_inputs,
    qwen_vl_image_size,
)

# Small patches and pixel budgets keep the images small; the second setting is Qwen3.5's
# (patches of 16, mean and std 0.5) with a 3-frame temporal patch.
SETTINGS = [
    dict(patch_size=4, merge_size=2, min_pixels=24 * 24, max_pixels=48 * 48),
    dict(
        patch_size=2,
        temporal_patch_size=3,
        merge_size=2,
        min_pixels=16 * 16,
        max_pixels=40 * 40,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ),
]
# Landscape, portrait, square, a size already on the grid, tiny (upscaled) and large
# (downscaled) images, and a thin one.
SIZES = [(37, 53), (61, 23), (40, 40), (32, 48), (5, 7), (150, 90), (4, 300)]
QWEN_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}


def hf_image_processor(settings):
    _, transformers = hf_modules()
    kwargs = dict(settings)
    if "image_mean" in kwargs:
        kwargs["do_normalize"] = True
    return transformers.Qwen2VLImageProcessorPil(**kwargs)


def test_sizes_equal_smart_resize():
    _, transformers = hf_modules()
    smart_resize = transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.smart_resize
    for height in (1, 3, 14, 27, 28, 42, 100, 1000, 3000):
        for width in (1, 5, 28, 55, 70, 640, 2000):
            for factor, low, high in ((28, 56 * 56, 28 * 28 * 1280), (8, 16 * 16, 64 * 64)):
                try:
                    expected = smart_resize(height, width, factor, low, high)
                except ValueError:
                    with raises_naming(f"{height}x{width}", "200"):
                        qwen_vl_image_size(
                            height, width, factor=factor, min_pixels=low, max_pixels=high
                        )
                    continue
                ours = qwen_vl_image_size(
                    height, width, factor=factor, min_pixels=low, max_pixels=high
                )
                assert ours == expected, (height, width, factor)


@pytest.mark.parametrize("settings", SETTINGS)
def test_inputs_equal_the_pil_image_processor_bit_for_bit(settings):
    rng = np.random.default_rng(0)
    modes = ["RGB", "L", "RGBA"]
    images = [random_image(rng, h, w, modes[i % 3]) for i, (h, w) in enumerate(SIZES)]
    expected = hf_image_processor(settings)(images, return_tensors="np")
    ours = qwen_vl_image_inputs(images, **settings)
    for key in ("pixel_values", "image_grid_thw"):
        assert ours[key].dtype == expected[key].dtype, key
        np.testing.assert_array_equal(ours[key], expected[key], err_msg=key)
    merge = settings["merge_size"] ** 2
    assert ours["num_soft_tokens_per_image"] == [
        int(g.prod()) // merge for g in expected["image_grid_thw"]
    ]


def test_the_default_settings_equal_transformers():
    """transformers' defaults (patches of 14, CLIP's mean and std) on one image."""
    rng = np.random.default_rng(1)
    images = [random_image(rng, 60, 90)]
    expected = hf_image_processor({})(images, return_tensors="np")
    ours = qwen_vl_image_inputs(images)
    np.testing.assert_array_equal(ours["pixel_values"], expected["pixel_values"])
    np.testing.assert_array_equal(ours["image_grid_thw"], expected["image_grid_thw"])


def test_patches_are_merge_windows_of_repeated_frames():
    """On an image already of its size: the m x m patches of a merge window are consecutive,
    each flattened [C, T, p, p] with the frame repeated T times."""
    rng = np.random.default_rng(2)
    image = rng.integers(0, 256, (8, 16, 3), dtype=np.uint8)
    inputs = qwen_vl_image_inputs(
        [image],
        patch_size=2,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=64,
        max_pixels=256,
        image_mean=None,
        image_std=None,
    )
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 8]]
    patches = inputs["pixel_values"].reshape(4 // 2, 8 // 2, 2, 2, 3, 2, 2, 2)
    for gy, gx, my, mx in np.ndindex(2, 4, 2, 2):
        y, x = 2 * (2 * gy + my), 2 * (2 * gx + mx)
        block = image[y : y + 2, x : x + 2].transpose(2, 0, 1).astype(np.float64) / 255
        for t in range(2):
            np.testing.assert_allclose(patches[gy, gx, my, mx, :, t], block, rtol=1e-7)
    none = qwen_vl_image_inputs([], patch_size=2)
    assert none["pixel_values"].shape == (0, 24) and none["image_grid_thw"].shape == (0, 3)


def qwen_processor(directory, image_processor):
    """transformers' `Qwen3VLProcessor` (Qwen3.5's) on the test tokenizer; its class checks
    are skipped (the video processor it insists on needs torchvision)."""
    _, transformers = hf_modules()

    class Processor(transformers.Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return Processor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


def test_chat_with_images_gives_the_processors_token_ids(tmp_path):
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    directory = write_image_tokenizer(tmp_path / "qwen_tokenizer", QWEN_TOKENS, marker)
    settings = SETTINGS[0]
    processor = qwen_processor(directory, hf_image_processor(settings))
    tok = HFTokenizer.from_directory(directory)
    rng = np.random.default_rng(3)
    images = [random_image(rng, 30, 50), random_image(rng, 16, 16)]
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "what is 12 + 7?"}],
        },
        {"role": "assistant", "content": "the answer is 19."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and?"}]},
        {"role": "assistant", "content": "fine, thank you!"},
    ]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False)
    expected = processor(text=[text], images=[images])["input_ids"][0]

    ids, where = encode_chat(tok, messages)
    inputs = qwen_vl_image_inputs(images, **settings)
    image_token_id = tok.encode("<|image_pad|>")[0]
    expanded, expanded_where = expand_image_tokens(
        ids, inputs["num_soft_tokens_per_image"], image_token_id=image_token_id, where=where
    )
    assert len(set(inputs["num_soft_tokens_per_image"])) == 2
    assert expanded.tolist() == list(expected)
    assert expanded_where.sum() == where.sum()


def test_bad_arguments_are_named():
    with raises_naming("resample"):
        qwen_vl_image_inputs([np.zeros((8, 8, 3), np.uint8)], resample="cubic")
    with raises_naming("height", "0x5"):
        qwen_vl_image_size(0, 5)
