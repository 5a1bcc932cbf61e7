"""Gemma 4 vision-language checkpoints: transformers reloads what we save, weights and config
alike, and what the model cannot reproduce is refused by name."""

import json
import shutil

import jax
import numpy as np
import pytest

from tests._helpers import raises_naming
from tests._hf import hf_modules, tiny_gemma4_vlm
from tunelib.formats import LoadOptions, load_hf_vision_language, save_hf_vision_language


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf_vlm = tiny_gemma4_vlm(seed=2)
    directory = tmp_path_factory.mktemp("gemma4_vlm") / "hf"
    hf_vlm.save_pretrained(directory)
    return hf_vlm, directory


def test_transformers_reloads_our_save(checkpoint, tmp_path):
    torch, transformers = hf_modules()
    hf_vlm, directory = checkpoint
    loaded = load_hf_vision_language(directory)
    saved = save_hf_vision_language(
        tmp_path / "ours", loaded.graphdef, loaded.params, hf_config=loaded.hf_config
    )
    reloaded = transformers.Gemma4ForConditionalGeneration.from_pretrained(saved).eval()
    expected, got = hf_vlm.state_dict(), reloaded.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert reloaded.config.text_config.use_bidirectional_attention == "vision"
    vision = [m.config.vision_config.to_dict() for m in (reloaded, hf_vlm)]
    ours, theirs = ({k: x for k, x in c.items() if k != "dtype"} for c in vision)
    assert ours == theirs
    assert reloaded.config.image_token_id == hf_vlm.config.image_token_id
    # And we load our save back bit for bit.
    again = load_hf_vision_language(saved)
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(loaded.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_load_options_or_keywords_and_the_default_placement(checkpoint):
    _, directory = checkpoint
    options = LoadOptions(param_dtype="float16", remat=True)
    by_options = load_hf_vision_language(directory, options)
    by_keywords = load_hf_vision_language(directory, param_dtype="float16", remat=True)
    assert by_options.config == by_keywords.config and by_options.config.remat
    assert by_options.vision_config == by_keywords.vision_config
    assert by_options.vision_config.param_dtype == "float16"
    for a, b in zip(*(jax.tree.leaves(c.params) for c in (by_options, by_keywords)), strict=True):
        assert a.dtype == b.dtype == np.float16
        np.testing.assert_array_equal(a, b)
    mesh = jax.make_mesh((1,), ("model",), devices=jax.devices()[:1])
    with raises_naming("mesh", "default device"):
        load_hf_vision_language(directory, options, mesh=mesh)


def test_every_top_level_config_field_is_known():
    """The sub-configs are read, the image token id placed; the other token ids (begin and
    end of image, audio, video) only mark the prompt and are kept in `hf_config`. A field
    transformers adds fails here until it is read or refused."""
    _, transformers = hf_modules()
    assert set(transformers.Gemma4Config.__annotations__) == {
        "text_config", "vision_config", "audio_config", "image_token_id", "boi_token_id",
        "eoi_token_id", "video_token_id", "boa_token_id", "eoa_token_index", "audio_token_id",
        "initializer_range", "tie_word_embeddings",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda c: c["text_config"].update(use_bidirectional_attention="all"),
         "use_bidirectional_attention"),
        (lambda c: c.update(audio_config={"model_type": "gemma4_audio"}), "audio_config"),
        (lambda c: c["vision_config"].update(new_field=1), "new_field"),
        (lambda c: c["vision_config"].update(attention_dropout=0.1), "attention_dropout"),
    ],
)  # fmt: skip
def test_what_the_model_cannot_reproduce_is_refused_by_name(checkpoint, tmp_path, edit, named):
    _, directory = checkpoint
    copy = shutil.copytree(directory, tmp_path / "edited")
    config = json.loads((copy / "config.json").read_text())
    edit(config)
    (copy / "config.json").write_text(json.dumps(config))
    with raises_naming(named):
        load_hf_vision_language(copy)
