"""The Hugging Face tokenizers the data tests share: built once per test session, no download.

Imports happen inside the fixtures: pytest loads this file in its controlling process too,
which should not pay for importing tunelib.
"""

import pytest


@pytest.fixture(scope="session")
def hf_directory(tmp_path_factory):
    """A ChatML-style BPE tokenizer whose chat template marks assistant turns."""
    from tests._hf import write_tokenizer

    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def hf_tok(hf_directory):
    from tunelib.data import HFTokenizer

    return HFTokenizer.from_directory(hf_directory)


@pytest.fixture(scope="session")
def bos_tok(tmp_path_factory):
    """The same tokenizer with a post-processor that starts every text with BOS, as Llama's."""
    from tests._hf import write_tokenizer
    from tunelib.data import HFTokenizer

    return HFTokenizer.from_directory(write_tokenizer(tmp_path_factory.mktemp("bos"), add_bos=True))


@pytest.fixture(scope="session")
def transformers_tok(hf_directory):
    """`transformers`' own reading of `hf_directory`, the reference."""
    from tests._hf import hf_modules

    _, transformers = hf_modules()
    return transformers.AutoTokenizer.from_pretrained(hf_directory)
