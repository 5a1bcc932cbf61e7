"""`sample` and `completion_logps` with images: a tiny Gemma 4 vision-language model's
greedy tokens equal transformers' `generate`, the prefilled images copied to every completion
of a group, and the trainer's log-probs equal the sampler's."""

import jax
import numpy as np
import pytest
from flax import nnx

from tests._helpers import raises_naming
from tests._hf import (
    BOI_TOKEN,
    EOI_TOKEN,
    GEMMA4_VLM_PIXELS,
    IMAGE_TOKEN,
    hf_greedy_with_images,
    tiny_gemma4_vlm,
)
from tests.models.test_vision import random_images
from tunelib.data import expand_image_tokens, gemma4_image_inputs
from tunelib.formats import load_hf_vision_language
from tunelib.models import Decoder, DecoderConfig
from tunelib.rollout import SamplingConfig, completion_logps, sample

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf_vlm = tiny_gemma4_vlm(seed=1)
    directory = tmp_path_factory.mktemp("gemma4_vlm")
    hf_vlm.save_pretrained(directory)
    return hf_vlm, load_hf_vision_language(directory)


def test_greedy_tokens_with_an_image_equal_generate_in_every_completion_of_a_group(models):
    hf_vlm, loaded = models
    inputs = gemma4_image_inputs(random_images()[:1], **GEMMA4_VLM_PIXELS)
    prompt, _ = expand_image_tokens(
        [5, 6, IMAGE_TOKEN, 7, 8], inputs["num_soft_tokens_per_image"],
        image_token_id=IMAGE_TOKEN, boi_token_id=BOI_TOKEN, eoi_token_id=EOI_TOKEN,
    )  # fmt: skip
    images = {name: inputs[name] for name in ("pixel_values", "image_position_ids")}
    generated = hf_greedy_with_images(hf_vlm, prompt, images, IMAGE_TOKEN, NEW_TOKENS)
    config = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=0.0, stop_tokens=())
    out = sample(
        loaded.graphdef, loaded.params, prompt[None], np.ones((1, len(prompt)), bool),
        jax.random.key(0), config, group_size=2, images=inputs,
    )  # fmt: skip
    assert len(set(generated.tolist())) > 3  # not a degenerate repetition
    np.testing.assert_array_equal(np.asarray(out.tokens), np.stack([generated, generated]))
    # The trainer's recomputation, the images encoded once for the group, gives the
    # sampler's log-probs.
    logps = jax.jit(completion_logps, static_argnums=0)(
        loaded.graphdef, loaded.params, prompt[None], np.ones((1, len(prompt)), bool),
        out.tokens, out.where, temperature=out.temperature, images=inputs,
    )  # fmt: skip
    np.testing.assert_allclose(logps, out.logps, atol=1e-5, rtol=0)


def test_images_for_a_model_that_reads_none_are_refused():
    config = DecoderConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, head_dim=8,
    )  # fmt: skip
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    images = gemma4_image_inputs(random_images()[:1], **GEMMA4_VLM_PIXELS)
    with raises_naming("images", "VisionLanguageModel"):
        sample(
            graphdef, params, np.ones((1, 3), np.int32), np.ones((1, 3), bool),
            jax.random.key(0), SamplingConfig(max_new_tokens=2), images=images,
        )  # fmt: skip


def test_prompts_whose_image_tokens_are_not_the_images_soft_tokens_are_refused(models):
    """A marker left unexpanded (one image token for an image of many soft tokens) would
    leave the image's features out and the model none the wiser: refused before sampling."""
    _, loaded = models
    inputs = gemma4_image_inputs(random_images()[:1], **GEMMA4_VLM_PIXELS)
    (soft,) = inputs["num_soft_tokens_per_image"]
    prompt = np.array([[5, 6, IMAGE_TOKEN, 7, 8]])
    with raises_naming("1 image tokens", f"{soft} soft tokens", "expand_image_tokens"):
        sample(
            loaded.graphdef, loaded.params, prompt, np.ones(prompt.shape, bool),
            jax.random.key(0), SamplingConfig(max_new_tokens=2), images=inputs,
        )  # fmt: skip
