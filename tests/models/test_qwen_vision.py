"""Qwen3.5's vision-language model against transformers' on one tiny
`Qwen3_5ForConditionalGeneration`: the image features of images of different grids (encoder
and merger), the logits of a padded batch of image+text prompts, 20 greedy tokens with an
image equal `generate`, transformers reloads our save, every config field read or refused."""

import jax
import numpy as np
import pytest
from flax import nnx

from tests._helpers import raises_naming
from tests._hf import (
    IMAGE_TOKEN,
    QWEN3_5_VLM_PIXELS,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
    hf_greedy_with_images,
    hf_modules,
    tiny_qwen3_5_vlm,
)
from tunelib.data import expand_image_tokens, qwen_vl_image_inputs
from tunelib.formats import load_hf_vision_language, save_hf_vision_language
from tunelib.formats._hf_qwen_vision import QWEN_VISION, qwen_vision_config_from_hf
from tunelib.models import QwenVisionConfig
from tunelib.rollout import SamplingConfig, completion_logps, sample

NEW_TOKENS = 20


def random_images(seed: int = 0) -> list[np.ndarray]:
    """Three images of different sizes and aspect ratios (grids 4 x 8, 4 x 4, 6 x 4)."""
    rng = np.random.default_rng(seed)
    shapes = [(20, 28, 3), (9, 9, 3), (23, 14, 3)]
    return [rng.integers(0, 256, shape, dtype=np.uint8) for shape in shapes]


@pytest.fixture(scope="module")
def hf_vlm():
    return tiny_qwen3_5_vlm()


@pytest.fixture(scope="module")
def loaded(hf_vlm, tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_5_vlm")
    hf_vlm.save_pretrained(directory)
    return load_hf_vision_language(directory)


def image_prompt(text: list[int], counts: list[int]) -> np.ndarray:
    """`text` with each image token expanded to its merged tokens, between the vision start
    and end tokens, as Qwen3.5's chat template and processor write it."""
    marked = []
    for token in text:
        marked += [VISION_START_TOKEN, token, VISION_END_TOKEN] if token == IMAGE_TOKEN else [token]
    tokens, _ = expand_image_tokens(np.array(marked), counts, image_token_id=IMAGE_TOKEN)
    return tokens


def test_every_vision_config_field_is_read_or_refused():
    _, transformers = hf_modules()
    fields = set(transformers.Qwen3_5VisionConfig.__annotations__)
    assert fields == QWEN_VISION.named
    assert QWEN_VISION.unknown(transformers.Qwen3_5VisionConfig().to_dict()) == []
    assert QWEN_VISION.unknown({"depth": 2, "new_field": 1}) == ["new_field"]
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


def test_image_features_match_transformers(hf_vlm, loaded):
    torch, _ = hf_modules()
    model = nnx.merge(loaded.graphdef, loaded.params)
    assert loaded.vision_config.rope_theta == 50.0 and loaded.config.mrope_section == (2, 1, 1)
    inputs = qwen_vl_image_inputs(random_images(), **QWEN3_5_VLM_PIXELS)
    counts = inputs["num_soft_tokens_per_image"]
    assert len(set(counts)) == 3
    # Two merge windows of padding rows past the images' patches.
    width = inputs["pixel_values"].shape[1]
    pixels = np.concatenate([inputs["pixel_values"], np.ones((8, width), np.float32)])
    features, real = nnx.jit(type(model).image_features)(
        model, pixels, image_grid_thw=inputs["image_grid_thw"]
    )
    np.testing.assert_array_equal(real, np.arange(len(features)) < sum(counts))
    with torch.no_grad():
        expected = hf_vlm.model.get_image_features(
            torch.tensor(inputs["pixel_values"]), torch.tensor(inputs["image_grid_thw"])
        ).pooler_output
    expected = np.concatenate([image.numpy() for image in expected])
    assert np.abs(expected).max() > 0.1
    np.testing.assert_allclose(features[: sum(counts)], expected, atol=1e-4, rtol=0)


def test_logits_of_padded_image_prompts_match_transformers(hf_vlm, loaded):
    """A left-padded prompt with a wide image and a right-padded one with a tall and a
    square image (3-D positions that differ by axis, deltas of both signs)."""
    torch, _ = hf_modules()
    model = nnx.merge(loaded.graphdef, loaded.params)
    inputs = qwen_vl_image_inputs(random_images(), **QWEN3_5_VLM_PIXELS)
    counts = inputs["num_soft_tokens_per_image"]
    first = image_prompt([5, 6, IMAGE_TOKEN, 7, 8, 9], counts[:1])
    second = image_prompt([5, IMAGE_TOKEN, 4, IMAGE_TOKEN, 9], counts[1:])
    length = max(len(first), len(second)) + 2
    tokens, where = np.zeros((2, length), np.int64), np.zeros((2, length), bool)
    tokens[0, length - len(first) :], where[0, length - len(first) :] = first, True
    tokens[1, : len(second)], where[1, : len(second)] = second, True
    with torch.no_grad():
        expected = hf_vlm(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(where.astype(np.int64)),
            pixel_values=torch.tensor(inputs["pixel_values"]),
            image_grid_thw=torch.tensor(inputs["image_grid_thw"]),
            mm_token_type_ids=torch.tensor((tokens == IMAGE_TOKEN).astype(np.int64)),
        ).logits.numpy()
    pixels = {k: inputs[k] for k in ("pixel_values", "image_grid_thw")}

    @nnx.jit
    def run(model, tokens, where, pixels):
        return model.unembed(model(tokens, where, **pixels))

    logits = np.asarray(run(model, tokens, where, pixels))
    np.testing.assert_allclose(logits[where], expected[where], atol=1e-4, rtol=0)


def test_transformers_reloads_our_save(hf_vlm, loaded, tmp_path):
    torch, transformers = hf_modules()
    saved = save_hf_vision_language(
        tmp_path / "ours", loaded.graphdef, loaded.params, hf_config=loaded.hf_config
    )
    reloaded = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(saved).eval()
    expected, got = hf_vlm.state_dict(), reloaded.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    vision = [m.config.vision_config.to_dict() for m in (reloaded, hf_vlm)]
    ours, theirs = ({k: x for k, x in c.items() if k != "dtype"} for c in vision)
    assert ours == theirs
    text = [m.config.text_config.rope_parameters for m in (reloaded, hf_vlm)]
    assert text[0] == text[1]
    for name in ("image_token_id", "video_token_id", "vision_start_token_id"):
        assert getattr(reloaded.config, name) == getattr(hf_vlm.config, name)


def test_every_top_level_config_field_is_known():
    """The sub-configs are read, the image token id placed; the other token ids (video,
    vision start and end) only mark the prompt and are kept in `hf_config`. A field
    transformers adds fails here until it is read or refused."""
    _, transformers = hf_modules()
    assert set(transformers.Qwen3_5Config.__annotations__) == {
        "text_config", "vision_config", "image_token_id", "video_token_id",
        "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings",
    }  # fmt: skip


def test_greedy_tokens_with_an_image_equal_generate(hf_vlm, loaded):
    """`sample(..., images=)`: the prefill places the image at 3-D positions and decoding
    continues from one past the largest (transformers' position delta), in both completions
    of a group; the trainer's recomputation over prompt and completion in one pass gives the
    sampler's log-probs (to the float32 rounding of the Gated DeltaNet's chunked form against
    its recurrent one)."""
    inputs = qwen_vl_image_inputs(random_images()[:1], **QWEN3_5_VLM_PIXELS)
    prompt = image_prompt([5, 6, IMAGE_TOKEN, 7, 8], inputs["num_soft_tokens_per_image"])
    images = {name: inputs[name] for name in ("pixel_values", "image_grid_thw")}
    generated = hf_greedy_with_images(hf_vlm, prompt, images, IMAGE_TOKEN, NEW_TOKENS)
    config = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=0.0, stop_tokens=())
    where = np.ones((1, len(prompt)), bool)
    out = sample(
        loaded.graphdef, loaded.params, prompt[None], where, jax.random.key(0), config,
        group_size=2, images=inputs,
    )  # fmt: skip
    assert len(set(generated.tolist())) > 3  # not a degenerate repetition
    np.testing.assert_array_equal(np.asarray(out.tokens), np.stack([generated, generated]))
    # One forward pass over each prompt (its image again) and its completion: the 3-D
    # positions of the whole sequence continue where the sampler's delta did.
    twice = {k: np.concatenate([inputs[k]] * 2) for k in ("pixel_values", "image_grid_thw")}
    logps = jax.jit(completion_logps, static_argnums=0)(
        loaded.graphdef, loaded.params, np.stack([prompt] * 2), np.concatenate([where] * 2),
        out.tokens, out.where, temperature=out.temperature, images=twice,
    )  # fmt: skip
    np.testing.assert_allclose(logps, out.logps, atol=1e-4, rtol=0)
