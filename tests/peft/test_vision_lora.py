"""LoRA on a vision-language model's language model (Gemma 4's and Qwen3.5's), its vision
encoder frozen: one optimizer step through images, the fused log-prob head and
`completion_logps`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tunelib import peft
from tunelib.data import expand_image_tokens, gemma4_image_inputs, qwen_vl_image_inputs
from tunelib.models import (
    PROJECTION_KERNELS,
    DecoderConfig,
    QwenVisionConfig,
    VisionConfig,
    VisionLanguageModel,
)
from tunelib.rollout import completion_logps

IMAGE = 15
TEXT = DecoderConfig(
    vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=2, head_dim=16, tie_word_embeddings=True,
    layer_types=("sliding_attention", "full_attention"), sliding_window=4,
)  # fmt: skip
VISION = VisionConfig(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, head_dim=8, patch_size=2, pooling_kernel_size=2,
    position_embedding_size=8, use_clipped_linears=True, standardize=True,
)  # fmt: skip


QWEN_TEXT = DecoderConfig(
    vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, use_qk_norm=True,
    norm_offset=True, attention_output_gate=True, partial_rotary_factor=0.5,
    mrope_section=(2, 1, 1),
)  # fmt: skip
QWEN_VISION = QwenVisionConfig(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
    out_hidden_size=32, num_position_embeddings=16,
)  # fmt: skip


def gemma4_model_and_images(image):
    model = VisionLanguageModel(
        TEXT, VISION, image_token_id=IMAGE, bidirectional=True, rngs=nnx.Rngs(0)
    )
    images = gemma4_image_inputs([image], patch_size=2, max_soft_tokens=4, pooling_kernel_size=2)
    return model, images, ("vision_tower", "embed_vision")


def qwen3_5_model_and_images(image):
    model = VisionLanguageModel(QWEN_TEXT, QWEN_VISION, image_token_id=IMAGE, rngs=nnx.Rngs(0))
    images = qwen_vl_image_inputs([image], patch_size=2, min_pixels=16, max_pixels=64)
    return model, images, ("visual",)


@pytest.mark.parametrize("family", [gemma4_model_and_images, qwen3_5_model_and_images])
def test_lora_on_the_language_model_leaves_the_vision_encoder_as_it_was(family):
    rng = np.random.default_rng(0)
    model, images, vision_parts = family(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    rule = peft.LoraRule(pattern="language_model/" + PROJECTION_KERNELS, rank=2)
    adapters = peft.init_lora(params, [rule], key=jax.random.key(1))
    assert set(adapters) == {"language_model"}  # no vision projection matches the rule
    prompt, _ = expand_image_tokens([1, IMAGE, 5], images["num_soft_tokens_per_image"],
                                    image_token_id=IMAGE)  # fmt: skip
    prompt, prompt_where = prompt[None], np.ones((1, prompt.size), bool)
    tokens, where = np.array([[3, 7, 2, 9]]), np.ones((1, 4), bool)
    tree = {"base": params, "lora": adapters}
    optimizer = optax.partition(
        {"lora": optax.sgd(0.5), "frozen": optax.set_to_zero()}, peft.lora_labels(tree)
    )

    @jax.jit
    def step(tree):
        def loss(tree):
            weights = peft.apply_lora(tree["base"], tree["lora"])
            logps = peft.lora(completion_logps)(
                graphdef, weights, prompt, prompt_where, tokens, where, images=images
            )
            return -logps.sum()

        grads = jax.grad(loss)(tree)
        updates, _ = optimizer.update(grads, optimizer.init(tree), tree)
        return optax.apply_updates(tree, updates), grads

    new, grads = step(tree)
    # The images reach the loss: the encoder has gradients, which the optimizer drops.
    vision_grads = jax.tree.leaves(grads["base"][vision_parts[0]])
    assert max(float(jnp.abs(g).max()) for g in vision_grads) > 0
    for part in (*vision_parts, "language_model"):
        for old, updated in zip(
            jax.tree.leaves(params[part]), jax.tree.leaves(new["base"][part]), strict=True
        ):
            np.testing.assert_array_equal(updated, old)
    moved = [
        float(jnp.abs(b).max())
        for b in jax.tree.leaves(new["lora"])
        if b.shape[0] == rule.rank  # the B factors, zero at the start
    ]
    assert min(moved) > 0
