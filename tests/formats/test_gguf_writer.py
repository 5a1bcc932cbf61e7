"""GGUF files out: what `save_gguf` writes reads back through `read_gguf` as the same config and
the same (or the same quantised) weights, and through transformers' own GGUF loader as the same
logits; tokenizer metadata keep their GGUF types; and the files it refuses to write."""

import dataclasses
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from tests._helpers import assert_within_float32_rounding, raises_naming, x64_copies
from tests._hf import TOKENIZER_SIZE, VOCAB_SIZE, hf_logits, hf_modules, write_tokenizer
from tests.formats.test_gguf import gguf_name, llama_cpp_permute
from tests.models.test_decoder import build, make_config
from tunelib.formats import (
    config_from_hf,
    convert_gguf,
    gguf_tensors,
    load_hf_checkpoint,
    read_gguf,
    save_gguf,
    save_hf_checkpoint,
)

gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency")

TINY = dict(vocab_size=96, max_position_embeddings=128, tie_word_embeddings=False)
# (model_type, dtype, config): each family's distinguishing options on. Llama with GQA, untied
# (F32) and tied with stacked layers and an MLP width (72) whose down projection's rows are not
# a multiple of Q8_0's 32-value blocks; Qwen2 with its q/k/v biases; Qwen3 with QK-norm and a
# head size (128) other than hidden / heads (16): transformers' GGUF loader ignores
# `qwen3.attention.key_length` and uses Qwen3's default head size, 128, so only that one can be
# compared with it.
CASES = {
    "llama-F32": ("llama", "F32", dict(num_key_value_heads=2)),
    "llama-Q8_0": (
        "llama",
        "Q8_0",
        dict(intermediate_size=72, tie_word_embeddings=True, scan_layers=True),
    ),
    "qwen2-F16": ("qwen2", "F16", dict(attention_bias=True, tie_word_embeddings=True)),
    "qwen3-BF16": ("qwen3", "BF16", dict(use_qk_norm=True, head_dim=128)),
}
# Read back only (transformers' loader would read another model): Qwen3 with a head size of 32,
# a bias on every projection and linear RoPE scaling; a Mistral, which GGUF calls llama.
READ_BACK_ONLY = {
    "qwen3-F32": (
        "qwen3",
        "F32",
        dict(
            use_qk_norm=True,
            head_dim=32,
            attention_bias=True,
            o_proj_bias=True,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "mistral-Q8_0": ("mistral", "Q8_0", dict(num_key_value_heads=1)),
}
TOKENS = np.random.default_rng(0).integers(0, TINY["vocab_size"], size=(2, 9))
WHERE = np.ones(TOKENS.shape, bool)
WHERE[0, :3] = False  # left padding
WHERE[1, -2:] = False  # right padding


def saved(tmp_path: Path, case: tuple, seed: int = 0):
    model_type, dtype, overrides = case
    config = make_config(**{**TINY, **overrides})
    graphdef, params = nnx.split(build(config, seed))
    path = save_gguf(tmp_path / "model.gguf", graphdef, params, model_type=model_type, dtype=dtype)
    return config, graphdef, params, path


def hf_tensors(tmp_path: Path, graphdef, params, model_type: str) -> dict[str, np.ndarray]:
    """The model's tensors under Hugging Face names and in its layout, in float32."""
    save_hf_checkpoint(
        tmp_path / "hf-f32", graphdef, params, model_type=model_type, dtype="float32"
    )
    return load_file(tmp_path / "hf-f32" / "model.safetensors")


def expected_type(dtype: str, shape: tuple[int, ...]) -> str:
    if len(shape) == 1:
        return "F32"
    return "F16" if dtype == "Q8_0" and shape[1] % 32 else dtype


@pytest.mark.parametrize("name", [*CASES, *READ_BACK_ONLY])
def test_read_back_gives_the_config_and_the_encoded_weights(tmp_path, name):
    """`read_gguf` gives back the config (floats rounded to float32, as GGUF stores them), and
    every tensor is the original encoded in its type: exactly the original in F32, its F16 or
    BF16 rounding, its Q8_0 blocks, with Llama's query / key rows put back in order."""
    case = {**CASES, **READ_BACK_ONLY}[name]
    config, graphdef, params, path = saved(tmp_path, case)
    model = read_gguf(path)
    read_config = config_from_hf(model.hf_config)
    eps = float(np.float32(config.rms_norm_eps))
    assert read_config == dataclasses.replace(config, rms_norm_eps=eps, scan_layers=False)
    expected_arch = "llama" if case[0] == "mistral" else case[0]
    assert model.metadata["general.architecture"] == expected_arch
    assert model.metadata["general.name"] == "model"
    file_types = {"F32": 0, "F16": 1, "Q8_0": 7, "BF16": 32}
    assert model.metadata["general.file_type"] == file_types[case[1]]

    original = hf_tensors(tmp_path, graphdef, params, case[0])
    types = {t.hf_name: t.type_name for t in model.tensors.values()}
    assert sorted(types) == sorted(original)
    assert ("lm_head.weight" in types) == (not config.tie_word_embeddings)
    for hf_name, values in gguf_tensors(model):
        x = original[hf_name]
        assert types[hf_name] == expected_type(case[1], x.shape), hf_name
        if types[hf_name] == "F32":
            np.testing.assert_array_equal(values, x, err_msg=hf_name)
        elif types[hf_name] == "F16":
            np.testing.assert_array_equal(values, x.astype(np.float16).astype(np.float32))
        elif types[hf_name] == "BF16":
            np.testing.assert_array_equal(values, x.astype(ml_dtypes.bfloat16).astype(np.float32))
        else:  # Q8_0: 32-value blocks of a row, each scaled by its largest |value| / 127
            blocks = x.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127
            error = np.abs(values.reshape(-1, 32) - blocks)
            # the scale is stored in float16: 127 steps of its rounding error on top
            assert (error <= (0.5 + 127 * 2**-11) * step + 1e-7).all(), hf_name
            assert not np.array_equal(values, x)


def test_f32_file_round_trips_bit_for_bit_with_llama_cpp_row_order(tmp_path):
    """An F32 file loads back into the very same parameters; in the file itself, Llama's query
    and key rows are in llama.cpp's order (each head's rotary halves interleaved)."""
    _, graphdef, params, path = saved(tmp_path, CASES["llama-F32"])
    loaded = load_hf_checkpoint(convert_gguf(path, tmp_path / "back"))
    flat = dict(nnx.to_flat_state(nnx.state(nnx.merge(graphdef, params), nnx.Param)))
    back = dict(nnx.to_flat_state(nnx.state(nnx.merge(loaded.graphdef, loaded.params), nnx.Param)))
    assert flat.keys() == back.keys()
    for key in flat:
        np.testing.assert_array_equal(np.asarray(back[key][...]), np.asarray(flat[key][...]))
    original = hf_tensors(tmp_path, graphdef, params, "llama")
    raw = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    for hf_name, heads in (("model.layers.1.self_attn.q_proj.weight", 4),
                           ("model.layers.1.self_attn.k_proj.weight", 2)):  # fmt: skip
        permuted = llama_cpp_permute(original[hf_name], heads)
        np.testing.assert_array_equal(raw[gguf_name(hf_name)], permuted)
        assert not np.array_equal(permuted, original[hf_name])


@pytest.mark.parametrize("name", CASES)
def test_transformers_gguf_loader_gives_our_logits(tmp_path, name):
    """transformers' GGUF loader reads the file (BF16 included) into the model tunelib reads
    back: equal logits on a padded batch."""
    torch, transformers = hf_modules()
    _, _, _, path = saved(tmp_path, CASES[name], seed=1)
    back = convert_gguf(path, tmp_path / "back")
    ours = load_hf_checkpoint(back)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    model = nnx.merge(ours.graphdef, ours.params)
    logits = np.asarray(model.unembed(model(TOKENS, where=WHERE)))
    expected = hf_logits(theirs, TOKENS, WHERE)
    assert np.abs(expected[WHERE]).max() > 1  # logits of some size
    # The two float32 forwards sum in different orders: transformers' logits are held within
    # 8x float32's rounding of ours, measured against our float64 forward of the same weights
    # (transformers' own is up to 2.2x ours here; a fixed 1e-4 on logits of 67 was 12 ulps
    # of them, 0.23 of it used on this CPU).
    tokens, where = x64_copies(TOKENS, WHERE)
    with jax.enable_x64(True):
        ours64 = load_hf_checkpoint(back, dtype="float64", param_dtype="float64")

        @jax.jit
        def exact_logits(params, tokens, where):
            model = nnx.merge(ours64.graphdef, params)
            return model.unembed(model(tokens, where=where))

        exact = np.asarray(exact_logits(ours64.params, tokens, where))
    assert exact.dtype == np.float64
    assert_within_float32_rounding(expected[WHERE], logits[WHERE], exact[WHERE], factor=8)


def tokenizer_metadata(vocab_size: int) -> dict:
    tokens = ["<pad>", "<s>", "</s>", *(f"t{i}" for i in range(3, vocab_size))]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array([3, 3, 3] + [1] * (vocab_size - 3), np.int32),
        "tokenizer.ggml.scores": [0.5 * i for i in range(vocab_size)],
        "tokenizer.ggml.merges": ["t 1", "t 2"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }


def test_tokenizer_metadata_keep_their_gguf_types(tmp_path):
    """Strings, lists of strings, int32 token types, float32 scores, uint32 ids and bool flags,
    as llama.cpp reads them; hf_config's pad id joins the tokenizer's, which read back as
    config token ids."""
    config = make_config(**TINY)
    graphdef, params = nnx.split(build(config))
    metadata = tokenizer_metadata(config.vocab_size)
    path = save_gguf(tmp_path / "tok.gguf", graphdef, params, model_type="llama",
                     hf_config={"bos_token_id": 1, "pad_token_id": 0},
                     tokenizer_metadata=metadata)  # fmt: skip
    fields = gguf.GGUFReader(path).fields
    types = {key: [gguf.GGUFValueType(t).name for t in fields[key].types] for key in fields}
    assert types["tokenizer.ggml.model"] == ["STRING"]
    assert types["tokenizer.ggml.tokens"] == ["ARRAY", "STRING"]
    assert types["tokenizer.ggml.merges"] == ["ARRAY", "STRING"]
    assert types["tokenizer.ggml.token_type"] == ["ARRAY", "INT32"]
    assert types["tokenizer.ggml.scores"] == ["ARRAY", "FLOAT32"]
    for key in ("bos", "eos", "padding"):
        assert types[f"tokenizer.ggml.{key}_token_id"] == ["UINT32"]
    assert types["tokenizer.ggml.add_bos_token"] == ["BOOL"]
    assert types["tokenizer.chat_template"] == ["STRING"]
    assert types["llama.attention.layer_norm_rms_epsilon"] == ["FLOAT32"]
    assert types["llama.block_count"] == ["UINT32"]
    model = read_gguf(path)
    for key, value in metadata.items():
        assert model.metadata[key] == (value.tolist() if isinstance(value, np.ndarray) else value)
    assert (model.hf_config["bos_token_id"], model.hf_config["eos_token_id"]) == (1, 2)
    assert model.hf_config["pad_token_id"] == 0


def test_a_tokenizer_saved_with_the_model_reads_back_in_tunelib_and_transformers(tmp_path):
    """`tunelib.formats.gguf_tokenizer_metadata` of a tokenizer with fewer ids (300) than the model
    has embedding rows (320): the vocabulary is padded as llama.cpp's converter pads it, and
    `gguf_tokenizer` and transformers' GGUF tokenizer encode as the original."""
    _, transformers = hf_modules()
    from tunelib.data import load_tokenizer
    from tunelib.formats import gguf_tokenizer, gguf_tokenizer_metadata

    tokenizer = load_tokenizer(write_tokenizer(tmp_path / "tokenizer"))
    config = make_config(**{**TINY, "vocab_size": VOCAB_SIZE})
    graphdef, params = nnx.split(build(config))
    given = gguf_tokenizer_metadata(tokenizer)
    path = save_gguf(tmp_path / "chat.gguf", graphdef, params, model_type="llama",
                     tokenizer_metadata=given)  # fmt: skip
    metadata = read_gguf(path).metadata
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    assert len(given["tokenizer.ggml.tokens"]) == TOKENIZER_SIZE
    assert tokens[:TOKENIZER_SIZE] == given["tokenizer.ggml.tokens"]
    assert tokens[TOKENIZER_SIZE:] == [f"[PAD{i}]" for i in range(TOKENIZER_SIZE, VOCAB_SIZE)]
    assert types[:TOKENIZER_SIZE] == given["tokenizer.ggml.token_type"]
    assert types[TOKENIZER_SIZE:] == [5] * (VOCAB_SIZE - TOKENIZER_SIZE)  # UNUSED
    text = "hello, how are you today? the answer is 19.<|im_end|>"
    expected = tokenizer.encode(text)
    assert gguf_tokenizer(path).encode(text) == expected
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert theirs(text, add_special_tokens=False)["input_ids"] == expected


def test_tokenizer_metadata_errors_name_the_key(tmp_path):
    config = make_config(**TINY)
    graphdef, params = nnx.split(build(config))
    good = tokenizer_metadata(config.vocab_size)
    path = tmp_path / "tok.gguf"

    def save(metadata, **kwargs):
        save_gguf(path, graphdef, params, model_type="llama", tokenizer_metadata=metadata,
                  **kwargs)  # fmt: skip

    with raises_naming("tokenizer.ggml.tokens", "97 tokens", "vocab_size, 96"):
        save({**good, "tokenizer.ggml.tokens": [*good["tokenizer.ggml.tokens"], "extra"]})
    with raises_naming("tokenizer.ggml.scores", "95 entries", "tokens 96"):
        save({**good, "tokenizer.ggml.scores": good["tokenizer.ggml.scores"][:-1]})
    with raises_naming("tokenizer.ggml.token_type", "integers"):
        save({**good, "tokenizer.ggml.token_type": [1.5] * config.vocab_size})
    with raises_naming("tokenizer.ggml.add_bos_token", "bool"):
        save({**good, "tokenizer.ggml.add_bos_token": 1})
    with raises_naming("tokenizer.ggml.eos_token_id", "range of UINT32"):
        save({**good, "tokenizer.ggml.eos_token_id": -1})
    with raises_naming("'llama.vocab_size'", "not a tokenizer key"):
        save({"llama.vocab_size": 3})
    with raises_naming("tokenizer.ggml.bos_token_id", "disagrees", "bos_token_id 5"):
        save(good, hf_config={"bos_token_id": 5})
    with raises_naming("eos_token_id", "is a list", "tokenizer.ggml.eos_token_id"):
        save(None, hf_config={"eos_token_id": [2, 3]})
    assert not path.exists()


def test_configs_gguf_cannot_express_and_bad_arguments_are_named(tmp_path):
    path = tmp_path / "m.gguf"

    def save(overrides, model_type="llama", dtype="F16"):
        graphdef, params = nnx.split(build(make_config(**{**TINY, **overrides})))
        save_gguf(path, graphdef, params, model_type=model_type, dtype=dtype)

    with raises_naming("sliding_window=3"):
        save(dict(sliding_window=3), model_type="mistral")
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    with raises_naming("rope_scaling", "'llama3'"):
        save(dict(rope_scaling=llama3))
    with raises_naming("'qwen2'", "attention_bias"):
        save({}, model_type="qwen2")
    with raises_naming("dtype", "'Q4_0'", "'F32', 'F16', 'Q8_0', 'BF16'"):
        save({}, dtype="Q4_0")
    with raises_naming("model_type", "'gemma'"):
        save({}, model_type="gemma")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_file_is_replaced_only_with_overwrite_and_only_once_complete(
    tmp_path, monkeypatch
):
    config = make_config(**TINY)
    graphdef, params = nnx.split(build(config))
    path = save_gguf(tmp_path / "m.gguf", graphdef, params, model_type="llama", dtype="F32")
    before = path.read_bytes()
    with raises_naming("m.gguf exists", "overwrite=True", error=FileExistsError):
        save_gguf(path, graphdef, params, model_type="llama", dtype="Q8_0")
    with raises_naming("is a directory", error=FileExistsError):
        save_gguf(tmp_path, graphdef, params, model_type="llama")

    calls = []
    quantize = gguf.quants.quantize

    def fail_on_the_fifth_tensor(data, qtype):
        calls.append(qtype)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return quantize(data, qtype)

    monkeypatch.setattr(gguf.quants, "quantize", fail_on_the_fifth_tensor)
    with pytest.raises(KeyboardInterrupt):
        save_gguf(path, graphdef, params, model_type="llama", dtype="Q8_0", overwrite=True)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no partial file left

    save_gguf(path, graphdef, params, model_type="llama", dtype="Q8_0", overwrite=True)
    assert {t.type_name for t in read_gguf(path).tensors.values()} == {"F32", "Q8_0"}
