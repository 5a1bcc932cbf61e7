"""GGUF's vocabulary in Hugging Face terms: the architectures and tensor types read, the
metadata keys and tensor names and what each becomes, and the check that a file is GGUF at
all, shared by the reader, the tokenizer and the writer."""

from pathlib import Path

# The architectures read, as `general.architecture` names them, with their `model_type`.
# llama.cpp writes Mistral checkpoints as `llama`.
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Tensor types dequantised (every one the `gguf` package reads that a GGUF model commonly
# holds; llama.cpp's importance-matrix types IQ* are refused by name).
GGUF_TENSOR_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip

# `{arch}.<key>` metadata and the config.json field each becomes.
CONFIG_KEYS: dict[str, str] = {
    "vocab_size": "vocab_size",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
}
# GGUF tensor names (per layer after `blk.N.`) and their Hugging Face module names.
LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# The first four bytes of every GGUF file.
MAGIC = b"GGUF"


def check_gguf_file(path: Path) -> None:
    """Raise `FileNotFoundError` when `path` is not a file, `ValueError` when it does not start
    with GGUF's magic bytes."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file.")
    with open(path, "rb") as file:
        head = file.read(len(MAGIC))
    if head != MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it starts with {head!r}, not {MAGIC!r}.")
