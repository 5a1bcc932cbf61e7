"""One `LoadOptions` for every loader: `load_hf_checkpoint`, `load_gguf` and `peft.gguf_base`
load the same model from it as from the same keyword arguments, a keyword argument replaces
that field of the options, and one that is not a field is an error naming it.
(`load_hf_vision_language`'s are in `test_hf_vision_language`.)"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from tests._gguf import write_tiny_gguf
from tunelib import peft
from tunelib.formats import LoadOptions, load_gguf, load_hf_checkpoint, save_hf_checkpoint
from tunelib.models import Decoder, DecoderConfig

CONFIG = DecoderConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1,
)  # fmt: skip
# Options that change what is loaded: the parameters' dtype, their stacking and the config.
OPTIONS = LoadOptions(dtype="bfloat16", param_dtype="float16", scan_layers=True, remat=True)
KEYWORDS = {"dtype": "bfloat16", "param_dtype": "float16", "scan_layers": True, "remat": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    graphdef, params = nnx.split(Decoder(CONFIG, rngs=nnx.Rngs(0)))
    folder = tmp_path_factory.mktemp("hf") / "llama"
    return save_hf_checkpoint(folder, graphdef, params, model_type="llama")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    texts = tuple(f"What is {a} + {b}? {a + b}" for a in range(0, 100, 7) for b in range(9))
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", texts, dtype="Q8_0")


def assert_same_load(a, b):
    assert a.config == b.config
    assert a.config.scan_layers and a.config.remat and a.config.dtype == "bfloat16"
    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        assert x.dtype == y.dtype == np.float16
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_load_hf_checkpoint_takes_options_or_keywords(checkpoint):
    assert_same_load(
        load_hf_checkpoint(checkpoint, OPTIONS), load_hf_checkpoint(checkpoint, **KEYWORDS)
    )
    assert_same_load(
        load_hf_checkpoint(checkpoint, options=OPTIONS), load_hf_checkpoint(checkpoint, **KEYWORDS)
    )


def test_load_gguf_takes_options_or_keywords(gguf_file):
    assert_same_load(load_gguf(gguf_file, OPTIONS), load_gguf(gguf_file, **KEYWORDS))


def test_gguf_base_takes_options_or_keywords(gguf_file):
    options = LoadOptions(param_dtype="float16", scan_layers=True)
    by_options = peft.gguf_base(gguf_file, options)
    by_keywords = peft.gguf_base(gguf_file, param_dtype="float16", scan_layers=True)
    assert by_options.config == by_keywords.config and by_options.config.scan_layers
    dense = [peft.dequantize_params(c.params) for c in (by_options, by_keywords)]
    for x, y in zip(*(jax.tree.leaves(d) for d in dense), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_gguf_base_refuses_shardings(gguf_file):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(ValueError, match="shardings must be None"):
        peft.gguf_base(gguf_file, LoadOptions(shardings={"embed_tokens": device}))
    with pytest.raises(ValueError, match="shardings must be None"):
        peft.gguf_base(gguf_file, shardings={"embed_tokens": device})


@pytest.mark.parametrize(
    "load", [load_hf_checkpoint, load_gguf, peft.gguf_base], ids=lambda f: f.__name__
)
def test_a_keyword_replaces_that_option_and_an_unknown_one_is_named(load, checkpoint, gguf_file):
    source = checkpoint if load is load_hf_checkpoint else gguf_file
    both = load(source, LoadOptions(scan_layers=True, remat=True), remat=False)
    assert both.config.scan_layers and not both.config.remat
    with pytest.raises(TypeError, match=r"\['scan_layer'\]; the load options are \['dtype'"):
        load(source, scan_layer=True)
    with pytest.raises(TypeError, match="options"):  # ours, or the runtime type check's
        load(source, {"scan_layers": True})


def test_load_options_are_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        OPTIONS.scan_layers = False
    with pytest.raises(TypeError):
        LoadOptions("float32")
    assert LoadOptions.from_arguments(OPTIONS) is OPTIONS
    assert LoadOptions.from_arguments(OPTIONS, dtype="float32") == dataclasses.replace(
        OPTIONS, dtype="float32"
    )
    assert LoadOptions.from_arguments(None, **KEYWORDS) == OPTIONS
