"""Gemma 4's vision encoder and multimodal embedder against transformers' on a tiny
`Gemma4ForConditionalGeneration`, and every field of its vision config read or refused."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import raises_naming
from tests._hf import GEMMA4_VLM_PIXELS, hf_modules, tiny_gemma4_vlm
from tunelib.data import gemma4_image_inputs
from tunelib.formats._hf_gemma4_vision import (
    VISION_CHECKED,
    VISION_READ,
    unknown_vision_fields,
    vision_config_from_hf,
    vision_hf_name,
)
from tunelib.models import DecoderConfig, MultimodalEmbedder, VisionConfig, VisionEncoder


def random_images(seed: int = 0) -> list[np.ndarray]:
    """Three images of different sizes and aspect ratios (padded to different lengths)."""
    rng = np.random.default_rng(seed)
    shapes = [(20, 28, 3), (9, 9, 3), (12, 8, 3)]
    return [rng.integers(0, 256, shape, dtype=np.uint8) for shape in shapes]


@pytest.fixture(scope="module")
def hf_vlm():
    return tiny_gemma4_vlm()


def test_every_vision_config_field_is_read_or_refused():
    _, transformers = hf_modules()
    fields = set(transformers.Gemma4VisionConfig.__annotations__)
    assert fields == set(VISION_READ) | set(VISION_CHECKED)
    assert unknown_vision_fields(transformers.Gemma4VisionConfig().to_dict()) == []
    assert unknown_vision_fields({"hidden_size": 8, "new_field": 1}) == ["new_field"]
    with raises_naming("rope_parameters"):
        vision_config_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}})
    with raises_naming("attention_dropout"):
        vision_config_from_hf({"attention_dropout": 0.1})
    with raises_naming("head_dim"):
        VisionConfig(head_dim=6)


def test_image_features_match_transformers(hf_vlm):
    torch, _ = hf_modules()
    hf = hf_vlm.config.to_dict()
    vision = vision_config_from_hf(hf["vision_config"])
    text = DecoderConfig(
        vocab_size=8, hidden_size=hf["text_config"]["hidden_size"], intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=1,
    )  # fmt: skip
    assert vision.use_clipped_linears and vision.standardize and vision.rope_theta == 50.0
    tensors = {name: t.numpy() for name, t in hf_vlm.state_dict().items()}

    class Tower(nnx.Module):
        def __init__(self):
            self.vision_tower = VisionEncoder(vision, rngs=nnx.Rngs(0))
            self.embed_vision = MultimodalEmbedder(vision, text, rngs=nnx.Rngs(0))

    graphdef, state = nnx.split(Tower())
    params = nnx.to_pure_dict(state)

    def fill(tree, path):
        for key, value in tree.items():
            if isinstance(value, dict):
                fill(value, (*path, key))
            else:
                name, kernel = vision_hf_name((*path, key))
                tree[key] = jnp.asarray(
                    np.swapaxes(tensors[name], -1, -2) if kernel else tensors[name]
                )

    fill(params, ())
    model = nnx.merge(graphdef, params)
    inputs = gemma4_image_inputs(random_images(), **GEMMA4_VLM_PIXELS)
    counts = inputs["num_soft_tokens_per_image"]
    assert len(set(counts)) > 1  # images of different soft-token counts, padded
    soft_tokens, real = model.vision_tower(inputs["pixel_values"], inputs["image_position_ids"])
    ours = np.asarray(model.embed_vision(soft_tokens))
    np.testing.assert_array_equal(np.asarray(real).sum(-1), counts)
    with torch.no_grad():
        expected = hf_vlm.model.get_image_features(
            torch.tensor(inputs["pixel_values"]), torch.tensor(inputs["image_position_ids"])
        ).pooler_output
    for i, features in enumerate(expected):
        np.testing.assert_allclose(ours[i, : counts[i]], features.numpy(), atol=1e-4, rtol=0)
