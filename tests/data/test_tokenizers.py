"""The tokenizers: the protocol, the character tokenizer, the Hugging Face tokenizer (checked
against transformers) and a model folder's tokenizer."""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import own_checks, raises_naming
from tests._hf import BOS, CHAT_TEMPLATE, IM_END, PAD, TOKENIZER_SIZE, write_tokenizer
from tunelib.data import DEFAULT_ALPHABET, CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

tok = CharTokenizer()
alphabet_text = st.text(alphabet=DEFAULT_ALPHABET, max_size=24)


def test_fixed_ids():
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(DEFAULT_ALPHABET) == 82
    # The arithmetic characters come first, in this order, from id 3.
    assert tok.encode("0123456789+-*= ") == list(range(3, 18))
    assert tok.encode("12+7=") == [4, 5, 13, 10, 16]
    assert tok.encode("") == []
    assert tok.decode([1, 4, 5, 13, 10, 16, 4, 12, 2, 0, 0]) == "12+7=19"
    assert isinstance(tok, Tokenizer)
    assert (tok.add_bos, tok.stop_ids, tok.chat_template) == (True, (2,), None)


@given(alphabet_text)
def test_round_trip(text):
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(3 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids, np.int32)) == text


@given(alphabet_text, alphabet_text, st.integers(0, 3))
def test_decode_skips_specials_and_stops_at_eos(text, after, num_pad):
    ids = [tok.bos_id, *tok.encode(text), tok.eos_id, *tok.encode(after), *[tok.pad_id] * num_pad]
    assert tok.decode(ids) == text
    assert tok.decode(ids, stop_at_eos=False) == text + after
    assert tok.decode([tok.pad_id] * num_pad + [tok.bos_id, *tok.encode(text)]) == text


@pytest.mark.parametrize(
    ("text", "char", "position"), [("12#3", "'#'", "position 2"), ("é", "'é'", "position 0")]
)
def test_unknown_character_is_named(text, char, position):
    with raises_naming(char, position, error=ValueError):
        tok.encode(text)


def test_decode_errors():
    with raises_naming("82", "position 1", error=ValueError):
        tok.decode([4, 82])
    with raises_naming("-1", error=ValueError):
        tok.decode([-1])
    with raises_naming("ids", "(1, 2)", error=ValueError):
        tok.decode(np.zeros((1, 2), np.int32))
    with raises_naming("ids", error=TypeError):
        tok.decode(np.array([1.0, 2.0]))
    with own_checks(), raises_naming("ids", "float64", error=TypeError):
        tok.decode(np.array([1.0, 2.0]))
    assert tok.decode([]) == ""


def test_custom_alphabet_and_equality():
    small = CharTokenizer("ab")
    assert small.vocab_size == 5
    assert small.encode("ba") == [4, 3]
    assert small.decode([1, 3, 4, 2]) == "ab"
    assert (
        small == CharTokenizer("ab") and small != tok and hash(small) == hash(CharTokenizer("ab"))
    )
    assert repr(tok) == "CharTokenizer()"
    assert repr(small) == "CharTokenizer(alphabet='ab')"
    with raises_naming("alphabet", "'a'", error=ValueError):
        CharTokenizer("aba")
    with raises_naming("alphabet", error=ValueError):
        CharTokenizer("")
    with raises_naming("text"):
        tok.encode(["1", "2"])
    with own_checks(), raises_naming("text", "list", error=TypeError):
        tok.encode(["1", "2"])


def test_both_tokenizers_implement_the_protocol(hf_tok, bos_tok):
    for tokenizer in (tok, hf_tok, bos_tok):
        assert isinstance(tokenizer, Tokenizer)
        assert tokenizer.stop_ids[0] == tokenizer.eos_id
    assert (bos_tok.add_bos, bos_tok.bos_id) == (True, 1)


def test_char_tokenizer_saves_and_loads(tmp_path):
    small = CharTokenizer("0123456789+=é\n")
    path = small.save(tmp_path / "model")
    assert path == tmp_path / "model" / "char_tokenizer.json"
    assert json.loads(path.read_text(encoding="utf-8"))["alphabet"] == small.alphabet
    assert sorted(p.name for p in path.parent.iterdir()) == ["char_tokenizer.json"]
    for loaded in (CharTokenizer.from_directory(path.parent), load_tokenizer(path.parent)):
        assert type(loaded) is CharTokenizer and loaded == small
        assert loaded.encode("1é=") == small.encode("1é=")
    tok.save(tmp_path / "default")
    assert load_tokenizer(tmp_path / "default") == tok


def test_load_tokenizer_reads_a_hugging_face_folder_and_names_bad_folders(tmp_path, hf_directory):
    loaded = load_tokenizer(hf_directory)
    assert isinstance(loaded, HFTokenizer) and loaded.chat_template == CHAT_TEMPLATE
    with raises_naming(
        str(tmp_path), "tokenizer.json", "char_tokenizer.json", error=FileNotFoundError
    ):
        load_tokenizer(tmp_path)
    with raises_naming(str(tmp_path / "nope"), error=FileNotFoundError):
        load_tokenizer(tmp_path / "nope")
    both = write_tokenizer(tmp_path / "both")
    tok.save(both)
    with raises_naming(str(both), "both", error=ValueError):
        load_tokenizer(both)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "char_tokenizer.json").write_text(json.dumps({"alphabet": "aa"}))
    with raises_naming("char_tokenizer.json", "repeated", error=ValueError):
        load_tokenizer(bad)
    (bad / "char_tokenizer.json").write_text(json.dumps({"alphabet": "ab", "eos_id": 5}))
    with raises_naming("char_tokenizer.json", "eos_id", error=ValueError):
        load_tokenizer(bad)
    (bad / "char_tokenizer.json").write_text(json.dumps({"alphabet": 5}))
    with raises_naming("char_tokenizer.json", "alphabet", error=ValueError):
        load_tokenizer(bad)


def test_special_tokens_and_template_come_from_the_files(hf_tok):
    tok = hf_tok
    assert tok.vocab_size == TOKENIZER_SIZE
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 3)
    assert tok.special_tokens == {"bos_token": BOS, "eos_token": IM_END, "pad_token": PAD}
    assert tok.chat_template == CHAT_TEMPLATE and tok.stop_ids == (3,)
    assert not tok.add_bos  # the tokenizer's post-processor adds nothing


def test_file_precedence_and_fallbacks(tmp_path):
    directory = write_tokenizer(tmp_path / "a", add_bos=True)
    assert HFTokenizer.from_directory(directory).add_bos  # read off the post-processor
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "add_bos_token": False}))
    assert not HFTokenizer.from_directory(directory).add_bos  # the config's flag wins
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert HFTokenizer.from_directory(directory).chat_template == "{{ messages[0]['content'] }}"
    # Special tokens from special_tokens_map.json, EOS from config.json, stops from both configs.
    del config["eos_token"], config["pad_token"]
    config_path.write_text(json.dumps(config))
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"pad_token": {"content": IM_END}})
    )
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 2, "vocab_size": 320}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 2]}))
    tok = HFTokenizer.from_directory(directory)
    assert (tok.eos_id, tok.pad_id, tok.stop_ids) == (2, 3, (2, 3))


def test_file_errors_are_named(tmp_path):
    with raises_naming("tokenizer.json", error=FileNotFoundError):
        HFTokenizer.from_directory(tmp_path)
    directory = write_tokenizer(tmp_path / "a")
    (directory / "config.json").write_text(json.dumps({"vocab_size": 200}))
    with raises_naming("vocab_size", "200", "299", error=ValueError):
        HFTokenizer.from_directory(directory)
    (directory / "config.json").unlink()
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "pad_token": "<nope>"}))
    with raises_naming("pad_token", "<nope>", error=ValueError):
        HFTokenizer.from_directory(directory)
    del config["eos_token"]
    config_path.write_text(json.dumps(config))
    with raises_naming("eos_token", error=ValueError):
        HFTokenizer.from_directory(directory)
    config_path.write_text(json.dumps({**config, "eos_token": IM_END, "chat_template": 5}))
    with raises_naming("chat_template", error=ValueError):
        HFTokenizer.from_directory(directory)


def test_encode_and_decode_match_transformers(hf_tok, transformers_tok):
    tok = hf_tok
    for text in ["the quick brown fox", "what is 12 + 7? <|im_end|> tail", "é ünïcode ✓", ""]:
        assert tok.encode(text) == transformers_tok(text, add_special_tokens=False)["input_ids"]
        ids = tok.encode(text)
        assert tok.decode(ids, stop_at_eos=False) == transformers_tok.decode(
            ids, skip_special_tokens=True
        )
    ids = tok.encode("hello world")
    assert tok.decode([*ids, tok.eos_id, *ids]) == "hello world"
    assert tok.decode([*ids, tok.eos_id, *ids], stop_at_eos=False) == "hello worldhello world"
    with raises_naming("300", "position 1", error=ValueError):
        tok.decode([5, 300])


def test_a_damaged_tokenizer_json_is_named(hf_directory, tmp_path):
    import shutil

    from tunelib.data import HFTokenizer

    directory = Path(shutil.copytree(hf_directory, tmp_path / "tok"))
    (directory / "tokenizer.json").write_text('{"version": "1.0", "model": ')  # cut short
    with raises_naming("tokenizer.json", "damaged", error=ValueError):
        HFTokenizer.from_directory(directory)
