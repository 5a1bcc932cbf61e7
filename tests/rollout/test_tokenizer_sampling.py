"""A sampler that knows its tokenizer: `SamplingConfig.from_tokenizer` and `Rollout.decode`."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._helpers import raises_naming
from tunelib.data import CharTokenizer
from tunelib.formats import gguf_tokenizer
from tunelib.rollout import NoStopTokenWarning, Rollout, SamplingConfig, sample


class NoStops(CharTokenizer):
    """A tokenizer whose model has no stop token."""

    stop_ids = ()
    pad_id = 3


def test_from_tokenizer_takes_its_stop_and_pad_ids():
    tok = CharTokenizer()
    config = SamplingConfig.from_tokenizer(tok, max_new_tokens=5, temperature=0.5, top_k=4)
    assert config == SamplingConfig(
        max_new_tokens=5, temperature=0.5, top_k=4, stop_tokens=(2,), pad_token=0
    )
    overridden = SamplingConfig.from_tokenizer(tok, max_new_tokens=5, stop_tokens=(2, 9))
    assert overridden.stop_tokens == (2, 9)
    assert SamplingConfig.from_tokenizer(NoStops(), max_new_tokens=2).pad_token == 3


def test_no_stop_token_warns_only_when_the_tokenizer_has_one():
    with pytest.warns(NoStopTokenWarning, match=r"stop_tokens=\(\).*\(2,\)"):
        config = SamplingConfig.from_tokenizer(CharTokenizer(), max_new_tokens=3, stop_tokens=())
    assert config.stop_tokens == ()
    assert issubclass(NoStopTokenWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SamplingConfig.from_tokenizer(NoStops(), max_new_tokens=3)
        SamplingConfig.from_tokenizer(CharTokenizer(), max_new_tokens=3)


def test_bad_tokenizer_and_fields_are_named():
    with pytest.raises(TypeError, match="tokenizer"):
        SamplingConfig.from_tokenizer(object(), max_new_tokens=3)
    with raises_naming("max_new_tokens", error=ValueError):
        SamplingConfig.from_tokenizer(CharTokenizer(), max_new_tokens=0)
    with pytest.raises(TypeError, match="top_q"):
        SamplingConfig.from_tokenizer(CharTokenizer(), max_new_tokens=3, top_q=0.5)


def test_decode_reads_only_the_completion():
    """Padding after the stop token is not decoded even when the pad id is a character."""
    tok = CharTokenizer()
    pad = tok.encode("x")[0]
    tokens = jnp.array([[*tok.encode("12"), tok.eos_id, pad, pad], tok.encode("a+b=c")])
    where = jnp.array([[True, True, True, False, False], [True] * 5])
    out = Rollout(
        tokens, where, jnp.zeros((2, 5)), where.sum(-1), jnp.array([False, True]), jnp.float32(1)
    )
    assert out.decode(tok) == ["12", "a+b=c"]
    assert out._replace(where=jnp.ones_like(where)).decode(tok) == ["12", "a+b=c"]
    assert jax.tree.map(lambda x: x[:0] if x.ndim else x, out).decode(tok) == []


def test_a_chat_model_stops_at_its_turn_end(tiny_gguf_file):
    """The tiny GGUF chat model (ChatML, `<|im_end|>` its EOS): completions from a config
    made for its tokenizer end at the stop id, and decode to the text before it. The model is
    random, so it is sampled hot (near uniform over 288 ids): 32 completions of 64 tokens
    meet a stop id about 7 times."""
    from tunelib import peft

    tok = gguf_tokenizer(tiny_gguf_file)
    graphdef, params, _, _ = peft.gguf_base(tiny_gguf_file, patterns=())
    im_end = tok.encode("<|im_end|>")
    assert tok.stop_ids and im_end[0] in tok.stop_ids
    prompt = tok.encode("Paris is the capital of")
    prompts, where = jnp.array([prompt]), jnp.ones((1, len(prompt)), bool)
    config = SamplingConfig.from_tokenizer(tok, max_new_tokens=64, temperature=10.0)
    out = sample(graphdef, params, prompts, where, jax.random.key(0), config, group_size=32)
    tokens, keep = np.asarray(out.tokens), np.asarray(out.where)
    stopped = ~np.asarray(out.truncated)
    assert stopped.any()
    for row, mask, ended, text in zip(tokens, keep, stopped, out.decode(tok), strict=True):
        ids = row[mask]
        assert np.isin(ids[:-1], tok.stop_ids).sum() == 0
        assert (ids[-1] in tok.stop_ids) == ended
        assert (row[~mask] == tok.pad_id).all()
        assert text == tok.decode(ids[:-1] if ended else ids)
        assert "<|im_end|>" not in text
