"""Qwen3.5's multimodal RoPE against transformers: the 3-D positions of padded image+text
prompts (`get_rope_index`), the interleaved angles, and text positions that rotate as plain
RoPE does."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import raises_naming
from tests._hf import hf_modules
from tunelib.models import Decoder, DecoderConfig, mrope_positions
from tunelib.models._mrope import mrope_angles, mrope_axes
from tunelib.models._rope import rope_frequencies

IMAGE = 9


def rope_index(tokens, where, grids, merge):
    """transformers' `Qwen3_5Model.get_rope_index` (it reads only the merge size)."""
    torch, transformers = hf_modules()
    model = transformers.Qwen3_5Model
    owner = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=merge)),
        get_vision_position_ids=lambda *a, **k: model.get_vision_position_ids(None, *a, **k),
    )
    ids = torch.tensor(tokens)
    positions, deltas = model.get_rope_index(
        owner,
        ids,
        mm_token_type_ids=(ids == IMAGE).int(),
        image_grid_thw=torch.tensor(grids),
        attention_mask=torch.tensor(where.astype(np.int64)),
    )
    return positions.numpy(), deltas.numpy()[:, 0]


def test_positions_equal_get_rope_index():
    # Left padding, a prompt without images, images of grids 2x3, 3x1 and 1x1 merged tokens
    # (a wide, a tall and a single one), two images in one row.
    rows = [
        [0, 0, 5, 6, 7, *[IMAGE] * 6, 8, 4, 4],
        [0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
        [1, 7, *[IMAGE] * 3, 8, 7, IMAGE, 8, 2, 3, 4, 4, 4],
    ]
    tokens = np.array(rows)
    where = tokens != 0
    grids = np.array([[1, 4, 6], [1, 6, 2], [1, 2, 2]])
    expected, deltas = rope_index(tokens, where, grids, 2)
    positions = jax.jit(mrope_positions, static_argnames=("image_token_id", "spatial_merge_size"))
    ours, our_deltas = positions(tokens, where, grids, image_token_id=IMAGE, spatial_merge_size=2)
    np.testing.assert_array_equal(ours, expected)
    np.testing.assert_array_equal(our_deltas, deltas)
    assert (our_deltas != 0).any() and (ours[0] != ours[1]).any() and (ours[1] != ours[2]).any()


@pytest.mark.parametrize("section", [[3, 3, 2], [11, 11, 10], [1, 2, 0]])
def test_angles_equal_transformers_interleaved_layout(section):
    torch, transformers = hf_modules()
    config = transformers.Qwen3_5TextConfig(
        head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.25, "mrope_section": section},
    )  # fmt: skip
    rotary = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(config)
    positions = np.random.default_rng(0).integers(0, 50, (3, 2, 5))
    with torch.no_grad():
        cos, sin = rotary(torch.zeros((), dtype=torch.float32), torch.tensor(positions))
    frequencies = rope_frequencies(16, theta=1e4)
    ours = mrope_angles(
        jnp.asarray(positions), frequencies, mrope_axes(tuple(section), 8), np.dtype("float32")
    )
    for theirs, mine in zip((cos, sin), ours, strict=True):
        np.testing.assert_allclose(theirs.numpy(), np.concatenate([mine, mine], -1), atol=2e-5)


def test_text_positions_on_three_axes_rotate_as_plain_rope():
    config = DecoderConfig(vocab_size=16, hidden_size=16, intermediate_size=16,
                           num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                           initializer_range=0.5, mrope_section=(2, 1, 1))  # fmt: skip
    model = Decoder(config, rngs=nnx.Rngs(0))
    tokens = jnp.array([[0, 3, 4, 5], [6, 7, 8, 9]])
    where = tokens != 0
    positions = jnp.maximum(jnp.cumsum(where, -1) - 1, 0)
    # Positions that differ by axis (not by a constant shift, which RoPE cannot see).
    scaled = jnp.stack([positions, 2 * positions, positions])

    @nnx.jit
    def run(model, three, scaled):
        cache = model.init_cache(2, 6)
        return (model(tokens, where), model(tokens, where, three), model(tokens, where, scaled),
                model.extend(tokens, where, cache, positions=three),
                model.extend(tokens, where, cache, positions=scaled)[1].lengths)  # fmt: skip

    plain, three, other, (hidden, cache), lengths = run(model, jnp.stack([positions] * 3), scaled)
    np.testing.assert_array_equal(three, plain)
    np.testing.assert_allclose(hidden, plain, atol=1e-6)
    np.testing.assert_array_equal(cache.lengths, where.sum(-1))
    assert np.abs(other - plain).max() > 1e-3
    # The cache continues from one past the largest position of each row.
    np.testing.assert_array_equal(lengths, 2 * where.sum(-1) - 1)
    with raises_naming("positions", "(3, 2, 4)"):
        Decoder(DecoderConfig(vocab_size=16, hidden_size=16, intermediate_size=16,
                              num_hidden_layers=1, num_attention_heads=2, head_dim=8),
                rngs=nnx.Rngs(0))(tokens, where, scaled)  # fmt: skip
    with raises_naming("mrope_section"):
        DecoderConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, mrope_section=(1, 2))  # fmt: skip
