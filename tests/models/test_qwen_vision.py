"""Qwen3.5's vision encoder and merger against transformers' on a tiny
`Qwen3_5ForConditionalGeneration`: the image features of images of different grids, every
field of the vision config read or refused."""

import jax
import numpy as np
import pytest
from flax import nnx

from tests._helpers import raises_naming
from tests._hf import QWEN3_5_VLM_PIXELS, hf_modules, tiny_qwen3_5_vlm
from tunelib.data import qwen_vl_image_inputs
from tunelib.formats._hf_qwen_vision import (
    QWEN_VISION_CHECKED,
    QWEN_VISION_READ,
    qwen_vision_config_from_hf,
    qwen_vision_from_hf,
    qwen_vision_hf_name,
    unknown_qwen_vision_fields,
)
from tunelib.models import QwenVisionConfig, QwenVisionEncoder


def random_images(seed: int = 0) -> list[np.ndarray]:
    """Three images of different sizes and aspect ratios (grids 4 x 8, 4 x 4, 6 x 4)."""
    rng = np.random.default_rng(seed)
    shapes = [(20, 28, 3), (9, 9, 3), (23, 14, 3)]
    return [rng.integers(0, 256, shape, dtype=np.uint8) for shape in shapes]


@pytest.fixture(scope="module")
def hf_vlm():
    return tiny_qwen3_5_vlm()


def encoder_of(hf_vlm) -> QwenVisionEncoder:
    """Our encoder with the weights of transformers' `model.visual`."""
    config = qwen_vision_config_from_hf(hf_vlm.config.vision_config.to_dict())
    graphdef, state = nnx.split(nnx.eval_shape(lambda: QwenVisionEncoder(config, rngs=nnx.Rngs(0))))
    tensors = {k: t.numpy() for k, t in hf_vlm.state_dict().items()}

    def read(keypath, leaf):
        name, kernel = qwen_vision_hf_name(("visual", *(k.key for k in keypath)))
        value = qwen_vision_from_hf(name, tensors[name], kernel)
        assert value.shape == leaf.shape, name
        return value

    params = jax.tree_util.tree_map_with_path(read, nnx.to_pure_dict(state))
    return nnx.merge(graphdef, params)


def test_every_vision_config_field_is_read_or_refused():
    _, transformers = hf_modules()
    fields = set(transformers.Qwen3_5VisionConfig.__annotations__)
    assert fields == set(QWEN_VISION_READ) | set(QWEN_VISION_CHECKED)
    assert unknown_qwen_vision_fields(transformers.Qwen3_5VisionConfig().to_dict()) == []
    assert unknown_qwen_vision_fields({"depth": 2, "new_field": 1}) == ["new_field"]
    assert qwen_vision_config_from_hf(transformers.Qwen3_5VisionConfig().to_dict()) == (
        QwenVisionConfig()
    )
    with raises_naming("rope_parameters"):
        qwen_vision_config_from_hf({"rope_parameters": {"rope_type": "default"}})
    with raises_naming("patch_size"):
        qwen_vision_config_from_hf({"patch_size": [16, 14]})
    with raises_naming("num_position_embeddings"):
        QwenVisionConfig(num_position_embeddings=10)
    with raises_naming("hidden_size", "num_heads"):
        QwenVisionConfig(hidden_size=24, num_heads=4)


def test_image_features_match_transformers(hf_vlm):
    torch, _ = hf_modules()
    encoder = encoder_of(hf_vlm)
    inputs = qwen_vl_image_inputs(random_images(), **QWEN3_5_VLM_PIXELS)
    counts = inputs["num_soft_tokens_per_image"]
    assert len(set(counts)) == 3
    # Two padding rows of patches (a merge window's worth each) past the images'.
    width = inputs["pixel_values"].shape[1]
    pixels = np.concatenate([inputs["pixel_values"], np.ones((8, width), np.float32)])
    features, real = nnx.jit(lambda m, p, g: m(p, g))(encoder, pixels, inputs["image_grid_thw"])
    np.testing.assert_array_equal(real, np.arange(len(features)) < sum(counts))
    with torch.no_grad():
        expected = hf_vlm.model.get_image_features(
            torch.tensor(inputs["pixel_values"]), torch.tensor(inputs["image_grid_thw"])
        ).pooler_output
    expected = np.concatenate([image.numpy() for image in expected])
    assert np.abs(expected).max() > 0.1
    np.testing.assert_allclose(features[: sum(counts)], expected, atol=1e-4, rtol=0)
