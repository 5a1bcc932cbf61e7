"""Gemma 4's vision-language model against transformers' on a tiny
`Gemma4ForConditionalGeneration`: the image features (encoder and multimodal embedder), the
logits of a padded batch of image+text prompts, every field of the vision config read or
refused."""

import numpy as np
import pytest
from flax import nnx

from tests._helpers import raises_naming
from tests._hf import (
    BOI_TOKEN,
    EOI_TOKEN,
    GEMMA4_VLM_PIXELS,
    IMAGE_TOKEN,
    hf_modules,
    tiny_gemma4_vlm,
)
from tunelib.data import expand_image_tokens, gemma4_image_inputs
from tunelib.formats import load_hf_vision_language
from tunelib.formats._hf_gemma4_vision import GEMMA4_VISION, vision_config_from_hf
from tunelib.models import VisionConfig


def random_images(seed: int = 0) -> list[np.ndarray]:
    """Three images of different sizes and aspect ratios (padded to different lengths)."""
    rng = np.random.default_rng(seed)
    shapes = [(20, 28, 3), (9, 9, 3), (12, 8, 3)]
    return [rng.integers(0, 256, shape, dtype=np.uint8) for shape in shapes]


@pytest.fixture(scope="module")
def hf_vlm():
    return tiny_gemma4_vlm()


@pytest.fixture(scope="module")
def loaded(hf_vlm, tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma4_vlm")
    hf_vlm.save_pretrained(directory)
    return load_hf_vision_language(directory)


def test_every_vision_config_field_is_read_or_refused():
    _, transformers = hf_modules()
    fields = set(transformers.Gemma4VisionConfig.__annotations__)
    assert fields == GEMMA4_VISION.named
    assert GEMMA4_VISION.unknown(transformers.Gemma4VisionConfig().to_dict()) == []
    assert GEMMA4_VISION.unknown({"hidden_size": 8, "new_field": 1}) == ["new_field"]
    assert vision_config_from_hf(transformers.Gemma4VisionConfig().to_dict()) == VisionConfig()
    with raises_naming("rope_parameters"):
        vision_config_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}})
    with raises_naming("attention_dropout"):
        vision_config_from_hf({"attention_dropout": 0.1})
    with raises_naming("head_dim"):
        VisionConfig(head_dim=6)


def test_image_features_match_transformers(hf_vlm, loaded):
    torch, _ = hf_modules()
    model = nnx.merge(loaded.graphdef, loaded.params)
    vision = loaded.vision_config
    assert vision.use_clipped_linears and vision.standardize and vision.rope_theta == 50.0
    inputs = gemma4_image_inputs(random_images(), **GEMMA4_VLM_PIXELS)
    counts = inputs["num_soft_tokens_per_image"]
    assert len(set(counts)) > 1  # images of different soft-token counts, padded
    features, real = nnx.jit(type(model).image_features)(
        model, inputs["pixel_values"], inputs["image_position_ids"]
    )
    np.testing.assert_array_equal(np.asarray(real).sum(-1), counts)
    with torch.no_grad():
        expected = hf_vlm.model.get_image_features(
            torch.tensor(inputs["pixel_values"]), torch.tensor(inputs["image_position_ids"])
        ).pooler_output
    for i, image in enumerate(expected):
        np.testing.assert_allclose(features[i, : counts[i]], image.numpy(), atol=1e-4, rtol=0)


def image_prompts(counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Two prompts with images, expanded as Gemma 4's processor does, one left-padded and
    one right-padded: `(tokens, where)`."""
    expand = dict(image_token_id=IMAGE_TOKEN, boi_token_id=BOI_TOKEN, eoi_token_id=EOI_TOKEN)
    first, _ = expand_image_tokens([5, 6, IMAGE_TOKEN, 7, 8, 9], counts[:1], **expand)
    second, _ = expand_image_tokens([5, IMAGE_TOKEN, 4, IMAGE_TOKEN, 9], counts[1:], **expand)
    length = max(len(first), len(second)) + 2
    tokens, where = np.zeros((2, length), np.int64), np.zeros((2, length), bool)
    tokens[0, length - len(first) :], where[0, length - len(first) :] = first, True
    tokens[1, : len(second)], where[1, : len(second)] = second, True
    return tokens, where


def test_logits_of_padded_image_prompts_match_transformers(hf_vlm, loaded):
    """Logits against transformers' and, in the same program, the prefill of a windowed
    cache (`extend`: the sliding layers' keys in a ring of the window's slots) against the
    forward pass."""
    torch, _ = hf_modules()
    model = nnx.merge(loaded.graphdef, loaded.params)
    assert model.bidirectional  # use_bidirectional_attention = "vision"
    inputs = gemma4_image_inputs(random_images(), **GEMMA4_VLM_PIXELS)
    tokens, where = image_prompts(inputs["num_soft_tokens_per_image"])
    positions = np.maximum(np.cumsum(where, -1) - 1, 0)
    hf_inputs = dict(
        input_ids=torch.tensor(tokens),
        attention_mask=torch.tensor(where.astype(np.int64)),
        position_ids=torch.tensor(positions),
        pixel_values=torch.tensor(inputs["pixel_values"]),
        image_position_ids=torch.tensor(inputs["image_position_ids"]),
    )
    image_types = torch.tensor((tokens == IMAGE_TOKEN).astype(np.int64))
    with torch.no_grad():
        expected = hf_vlm(**hf_inputs, mm_token_type_ids=image_types).logits.numpy()
        causal = hf_vlm(**hf_inputs).logits.numpy()  # no image blocks: causal everywhere
    # Image tokens attending within their image on the sliding layers changes the logits.
    assert np.abs(causal[where] - expected[where]).max() > 1e-2
    pixels = dict(
        pixel_values=inputs["pixel_values"], image_position_ids=inputs["image_position_ids"]
    )

    @nnx.jit
    def run(model, tokens, where, pixels):
        hidden = model(tokens, where, **pixels)
        cache = model.init_cache(2, tokens.shape[1] + 3, windowed=True)
        return model.unembed(hidden), hidden, model.extend(tokens, where, cache, **pixels)[0]

    logits, hidden, cached = run(model, tokens, where, pixels)
    np.testing.assert_allclose(np.asarray(logits)[where], expected[where], atol=1e-4, rtol=0)
    np.testing.assert_allclose(cached[where], hidden[where], atol=1e-5, rtol=0)
