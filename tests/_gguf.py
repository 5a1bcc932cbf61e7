"""A tiny GGUF model file with a tokenizer and a chat template, as tests write one: the
real SmolLM2 file's shape of things (byte-level BPE, ChatML, `<|im_end|>` = id 2) at a size
that loads in well under a second."""

from pathlib import Path

import numpy as np

# SmolLM2's specials in its order: <|im_end|> is id 2, the script's pad id, as in SmolLM2.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (  # SmolLM2's template without its default system turn
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZER_SIZE = 288  # the 256 byte symbols, the 3 specials and 29 merges


def write_tiny_gguf(path: Path, messages: tuple[str, ...], *, dtype: str = "F32") -> Path:
    """A random Llama (hidden 64, 2 layers, GQA, tied embeddings) in `dtype`, with a byte-level BPE
    trained on `messages` and SmolLM2's ChatML template, as one GGUF file.

    The weights are drawn in NumPy into an abstract decoder (no initialiser is compiled): every
    matrix and the embedding from N(0, 0.5^2), the norm scales 1. At the decoder's default
    scale (0.02) the residual stream is the last token's embedding, and every row repeats the
    prompt's final newline; at 0.5 with seed 1, the 8 greedy tokens of the test's two rows are
    varied, and each is ahead of the runner-up by 0.37 or more (the two sides' float32 logits
    differ by about 1e-5), so tunelib's tokens equal transformers' deterministically."""
    import jax
    import tokenizers
    from flax import nnx
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from tunelib.data import HFTokenizer
    from tunelib.formats import gguf_tokenizer_metadata, save_gguf
    from tunelib.models import Decoder, DecoderConfig

    inner = tokenizers.Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(messages, trainer)
    assert inner.get_vocab_size() == TOKENIZER_SIZE
    tokenizer = HFTokenizer(
        inner, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|im_end|>",
        unk_token="<|endoftext|>", chat_template=CHATML, add_bos=False,
    )  # fmt: skip
    config = DecoderConfig(
        vocab_size=TOKENIZER_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(1)

    def draw(x: jax.ShapeDtypeStruct) -> np.ndarray:
        value = np.ones(x.shape) if x.ndim == 1 else rng.normal(0, 0.5, x.shape)
        return value.astype(x.dtype)

    nnx.replace_by_pure_dict(params, jax.tree.map(draw, nnx.to_pure_dict(params)))
    metadata = gguf_tokenizer_metadata(tokenizer)
    return save_gguf(path, graphdef, params, model_type="llama", dtype=dtype,
                     tokenizer_metadata=metadata)  # fmt: skip
