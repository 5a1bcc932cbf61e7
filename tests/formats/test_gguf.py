"""GGUF files in: the config, the dequantised tensors in Hugging Face's layout, the conversion
into a checkpoint folder, checked against transformers' own GGUF loader; and the bad files."""

from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from tests._hf import hf_logits, hf_modules, tiny_hf_model
from tunelib.formats import convert_gguf, load_hf_checkpoint, read_gguf

gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency")

LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        _, _, layer, part = module.split(".", 3)
        return f"blk.{layer}.{LAYER[part]}.{suffix}"
    return f"{GLOBAL[module]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives Llama's query and key weights: each head's
    two rotary halves interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(path: Path, model, family: str, quant: str = "F32", **extra_keys) -> Path:
    """A transformers model written as llama.cpp writes a GGUF file: metadata, tensors with
    the 2-D weights in `quant` (norms stay F32), Llama's query / key rows permuted."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), family)
    u32 = {
        "block_count": config.num_hidden_layers, "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size, "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads, "vocab_size": config.vocab_size,
    }  # fmt: skip
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    u32 |= {"attention.key_length": head_dim, "rope.dimension_count": head_dim}
    for key, value in u32.items():
        writer.add_uint32(f"{family}.{key}", value)
    writer.add_float32(f"{family}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32(f"{family}.rope.freq_base", config.rope_parameters["rope_theta"])
    for key, value in extra_keys.items():
        writer.add_uint32(key, value)
    qtype = gguf.GGMLQuantizationType[quant]
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.detach().float().numpy()
        if family == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        if w.ndim == 2 and quant != "F32":
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def ours_and_transformers(tmp_path: Path, family: str, quant: str, **overrides):
    torch, transformers = hf_modules()
    if family == "llama":  # a Llama as released: no biases
        overrides = {"attention_bias": False, "mlp_bias": False, **overrides}
    if family == "qwen3":  # transformers' GGUF loader keeps Qwen3's default head size, 128
        overrides = {
            "head_dim": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
            **overrides,
        }
    source = tiny_hf_model(family, seed=3, **overrides)
    path = write_gguf(tmp_path / "model.gguf", source, family, quant)
    converted = convert_gguf(path, tmp_path / "hf")
    ours = load_hf_checkpoint(converted)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf", dtype=torch.float32
    ).eval()
    return ours, theirs


@pytest.mark.parametrize(
    ("family", "quant"),
    [("llama", "F32"), ("llama", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "Q4_0"), ("qwen3", "F16")],
)
def test_converted_logits_equal_transformers_on_the_same_file(tmp_path, family, quant):
    """The file's weights as transformers dequantises and reorders them: our logits on a padded
    batch equal its logits on the same file."""
    ours, theirs = ours_and_transformers(tmp_path, family, quant)
    tokens = np.random.default_rng(0).integers(0, ours.config.vocab_size, size=(2, 7))
    where = np.ones((2, 7), bool)
    where[1, 5:] = False
    model = nnx.merge(ours.graphdef, ours.params)
    logits = np.asarray(model.unembed(model(tokens, where=where)))
    np.testing.assert_allclose(logits[where], hf_logits(theirs, tokens, where)[where], atol=1e-4)


def test_llama_query_and_key_rows_are_put_back_in_hugging_face_order(tmp_path):
    hf_modules()
    source = tiny_hf_model("llama", seed=1)
    path = write_gguf(tmp_path / "m.gguf", source, "llama")
    convert_gguf(path, tmp_path / "hf")
    from safetensors.numpy import load_file

    converted = load_file(tmp_path / "hf" / "model.safetensors")
    for name, tensor in source.state_dict().items():
        if name in converted:
            np.testing.assert_array_equal(converted[name], tensor.detach().numpy(), err_msg=name)
    assert read_gguf(path).hf_config["tie_word_embeddings"] == source.config.tie_word_embeddings


def test_bad_files_are_errors_that_name_them(tmp_path):
    hf_modules()
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"notes\.gguf is not a GGUF file"):
        read_gguf(text)
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        read_gguf(tmp_path / "missing.gguf")
    good = write_gguf(tmp_path / "good.gguf", tiny_hf_model("llama", seed=0), "llama")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf is not a readable GGUF file"):
        read_gguf(cut)
    odd = write_gguf(tmp_path / "odd.gguf", tiny_hf_model("llama", seed=0), "llama",
                     **{"llama.expert_count": 4})  # fmt: skip
    with pytest.raises(ValueError, match=r"'llama\.expert_count' is not supported"):
        read_gguf(odd)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("work")
    with pytest.raises(FileExistsError, match="taken exists and is not empty"):
        convert_gguf(good, tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "work"
