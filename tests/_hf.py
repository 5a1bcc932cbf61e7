"""Tiny Hugging Face checkpoints, tokenizers and chat templates, built by the tests themselves.

Nothing downloads: `transformers` writes randomly initialised models of each family into a
temporary directory, and `tokenizers` trains a small byte-level BPE on a fixed text. Tests that
need `torch` and `transformers` get them from `hf_modules()`, which skips (naming both) when
they are missing, and fails instead when `TUNELIB_REQUIRE_HF=1` (as `.ci/run` sets), so CI
cannot pass with these tests skipped.

Typical use, for example by a recipe test:

    directory = write_tiny_checkpoint(tmp_path / "model", "qwen2")   # weights + tokenizer
    write_chat_jsonl(tmp_path / "data.jsonl", 16)                    # SFT records
"""

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REQUIRE_HF = "TUNELIB_REQUIRE_HF"
# The special tokens of the test tokenizer, ChatML-style as in Qwen.
PAD, BOS, IM_START, IM_END = "<pad>", "<s>", "<|im_start|>", "<|im_end|>"
# A ChatML template that marks assistant turns with {% generation %} and exercises what
# transformers' rendering does: trim_blocks / lstrip_blocks, loop variables, raise_exception,
# bos_token and the generation prompt.
CHAT_TEMPLATE = """\
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if loop.first %}{{ bos_token }}{% endif %}
<|im_start|>{{ message['role'] }}
{% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] | trim }}<|im_end|>{% endgeneration %}

{% else %}
{{ message['content'] | trim }}<|im_end|>

{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
# The same template without {% generation %} blocks (masks then come from rendering prefixes).
PLAIN_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace(
    "{% endgeneration %}", ""
)
VOCAB_SIZE = 320  # model rows; the tokenizer has TOKENIZER_SIZE ids, fewer, as in Qwen
TOKENIZER_SIZE = 300
_CORPUS = [
    "the quick brown fox jumps over the lazy dog. ",
    "what is 12 + 7? the answer is 19. ",
    "hello, how are you today? i am fine, thank you! ",
    "user assistant system: answer the question in one word. ",
    "0123456789 + - * = ( ) , . ? ! ",
]
# Tiny configs (hidden 64, 2 layers), transformers' field names; each family's distinguishing
# options are on: Llama 3 RoPE scaling and every bias, Qwen2 q/k/v biases (implied) with tied
# embeddings, Qwen3 QK-norm (implied) with N * D != H, Mistral a sliding window shorter than
# the test sequences, Qwen3-MoE 4 experts with top-2 routing renormalised, Gemma 2 a sliding
# then a full layer with attention and final soft-caps that bind (3 and 4), Gemma 3 a sliding
# layer (window 4, its own RoPE) then a full one (linear RoPE scaling), queries scaled by 24.
# Gemma 4 dense: 5 layers (sliding, full, sliding, sliding, full) whose last 2 share the keys
# and values of layers 0 and 1, with double-wide MLPs; full layers twice as wide with one
# key/value head that is also the value (attention_k_eq_v) and proportional RoPE rotating
# half of each head; per-layer inputs; a binding final soft-cap. Gemma 4 MoE: 4 experts, top
# 2, beside every dense MLP, full layers of transformers' default width ratio. gpt-oss: a
# sliding (window 4) then a full layer with sinks, 4 biased experts, top 2, a clamp (1.5) that
# binds, YaRN RoPE whose ramp falls inside the head (original context 64). DeepSeek-V3: 3
# layers, the first dense, latent attention with a compressed query, biases and interleaved
# YaRN RoPE whose `mscale_all_dim` scales the softmax; 8 routed experts in 4 groups (2 kept),
# top 2, one shared expert, a routing bias (randomised) and a scaling factor of 2.5.
# binds, YaRN RoPE whose ramp falls inside the head (original context 64). Qwen3.5: Gated
# DeltaNet layers around a gated full-attention one, twice as many value heads as key heads,
# a 3-tap convolution, RoPE on half of each head; Qwen3.5-MoE: a DeltaNet and a full layer,
# each with 4 fused experts, top 2, and a gated shared expert.
COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=3,
    pad_token_id=0,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# Qwen3.5: Gated DeltaNet layers around a gated full-attention one; its MoE, a DeltaNet and
# a full layer with experts and a gated shared expert.
_QWEN3_5 = dict(
    num_hidden_layers=3,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_conv_kernel_dim=3,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(rope_parameters=LLAMA3_ROPE, attention_bias=True, mlp_bias=True),
    "qwen2": dict(
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
    ),
    "qwen3": dict(
        head_dim=32, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}
    ),
    "mistral": dict(sliding_window=5),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
    ),
    "gemma2": dict(
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=4,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0,
    ),
    "gemma3_text": dict(
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
    "gemma4_text": dict(
        num_hidden_layers=5,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],
        sliding_window=4,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB_SIZE,
        final_logit_softcapping=5.0,
        rope_parameters={
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "rope_theta": 1e4,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    ),
    "gemma4_text_moe": dict(
        head_dim=16,
        global_head_dim=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
    "qwen3_5_text": _QWEN3_5,
    "qwen3_5_moe_text": dict(
        _QWEN3_5,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=24,
    ),
    "gpt_oss": dict(
        head_dim=16,
        intermediate_size=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "beta_fast": 8.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),
    "deepseek_v3": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,
        attention_bias=True,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        rope_interleave=True,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        routed_scaling_factor=2.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "beta_fast": 8.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64,
        },
    ),
}
_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "gemma4_text_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}


def hf_modules() -> tuple[Any, Any]:
    """`(torch, transformers)`; skips the test without them, or fails under `TUNELIB_REQUIRE_HF`."""
    try:
        import torch
        import transformers
    except ImportError as error:
        if os.environ.get(REQUIRE_HF) == "1":
            raise ImportError(
                f"{REQUIRE_HF}=1 but torch (CPU) and transformers are not importable ({error}); "
                "install the test extra: pip install -e '.[test]'"
            ) from error
        pytest.skip(
            f"needs torch (CPU) and transformers, from the test extra ({error}); "
            "pip install -e '.[test]'"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # One intra-op thread: the test workers share the cores, and PyTorch's spinning OpenMP
    # threads competing with another worker made a 30-layer `generate` ten times slower.
    torch.set_num_threads(1)
    return torch, transformers


def undocumented_config_fields(
    config_class: str, docs: Path, heading: str, popped: tuple[str, ...] = ()
) -> list[str]:
    """The fields `transformers`' `config_class` declares itself (not its base class's), and
    the `popped` ones its constructor reads, that the `## heading` section of `docs` does not
    name in backticks: a field transformers adds shows here until it is read or refused."""
    _, transformers = hf_modules()
    config = getattr(transformers, config_class)
    own = [f.name for f in dataclasses.fields(config) if f.name in config.__annotations__]
    text = docs.read_text()
    section = text[text.index(f"\n## {heading}\n") + 1 :]
    section = section[: section.index("\n## ")]
    return [f for f in (*own, *popped) if not re.search(rf"`{f}`", section)]


def model_class(family: str) -> Any:
    """The `transformers` causal-LM class of `family`."""
    _, transformers = hf_modules()
    return getattr(transformers, _CLASSES[family][1])


def tiny_hf_model(family: str, *, seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised `transformers` model of `family`, in float32 eval mode.

    Norm scales and biases are randomised too (transformers initialises them to 1 and 0), as
    are Gemma 4's router scales and layer scalars, gpt-oss's attention sinks (to unit
    size) and DeepSeek-V3's routing biases, so that a weight loaded into the wrong place
    changes the outputs.
    """
    torch, transformers = hf_modules()
    config_class = getattr(transformers, _CLASSES[family][0])
    config = config_class(**{**COMMON, **FAMILIES[family], **overrides})
    torch.manual_seed(seed)
    model = model_class(family)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.3 * torch.randn_like(param))
            elif name.endswith("sinks"):
                param.copy_(torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(1 + 0.3 * torch.randn_like(buffer))
            elif name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    return model


def write_tokenizer(
    directory: Path, *, chat_template: str = CHAT_TEMPLATE, add_bos: bool = False
) -> Path:
    """`tokenizer.json` (a byte-level BPE of `TOKENIZER_SIZE` ids) and `tokenizer_config.json`.

    The special tokens are pad (id 0), BOS (1), `<|im_start|>` (2) and `<|im_end|>` (3), the
    EOS. With `add_bos` the tokenizer's post-processor prepends BOS, as Llama's does.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_SIZE,
        special_tokens=[PAD, BOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer)
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
        )
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": {"content": IM_END, "special": True, "__type": "AddedToken"},
        "pad_token": PAD,
        "chat_template": chat_template,
        "model_max_length": 256,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


# A ChatML template that writes IMAGE_MARKER for each {"type": "image"} part of a content list.
IMAGE_CHAT_TEMPLATE = """\
{% for message in messages %}<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}{{ message['content'] }}\
{% else %}{% for part in message['content'] %}\
{% if part['type'] == 'image' %}IMAGE_MARKER{% else %}{{ part['text'] }}{% endif %}\
{% endfor %}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def write_image_tokenizer(
    directory: Path, special_tokens: dict[str, str], image_marker: str
) -> Path:
    """`write_tokenizer`'s tokenizer with a vision model's special tokens added (named in
    `tokenizer_config.json`'s `extra_special_tokens`, so that transformers' processors find
    them as attributes) and a chat template that writes `image_marker` for an image part."""
    from tokenizers import AddedToken, Tokenizer

    template = IMAGE_CHAT_TEMPLATE.replace("IMAGE_MARKER", image_marker)
    write_tokenizer(directory, chat_template=template)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in special_tokens.values()])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = special_tokens
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


def write_tiny_checkpoint(
    directory: Path,
    family: str = "qwen2",
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: int | str | None = None,
    tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """A tiny checkpoint of `family` written by `transformers`, with a tokenizer and template.

    Args:
      directory: where to write (created).
      family: a key of `FAMILIES`.
      seed: torch seed of the weights.
      dtype: "float32" or "bfloat16", the dtype the weights are saved in.
      max_shard_size: shard the weights (`save_pretrained`'s argument), e.g. 20_000 bytes.
      tokenizer: also write `tokenizer.json` and `tokenizer_config.json` (`write_tokenizer`).
      **overrides: config fields.
    """
    torch, _ = hf_modules()
    model = tiny_hf_model(family, seed=seed, **overrides)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    if tokenizer:
        write_tokenizer(directory)
    return directory


def hf_greedy(model: Any, prompts: np.ndarray, where: np.ndarray, count: int) -> np.ndarray:
    """`count` tokens `generate` decodes greedily after the left-padded `prompts` (`where`
    True on real tokens), with stop tokens off."""
    torch, _ = hf_modules()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        generated = model.generate(
            input_ids=torch.tensor(np.where(where, prompts, 0)),
            attention_mask=torch.tensor(where.astype(np.int64)),
            max_new_tokens=count,
            do_sample=False,
            pad_token_id=0,
        )
    return generated[:, prompts.shape[1] :].numpy()


def assert_reloads_equal(
    family: str, saved: Path, reference: Any, tokens: np.ndarray, where: np.ndarray
) -> None:
    """transformers loads the checkpoint tunelib `saved` with `reference`'s weights, bit for
    bit, and the same logits at the real tokens of `tokens` (`where`)."""
    torch, _ = hf_modules()
    again = model_class(family).from_pretrained(saved).eval()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    expected = hf_logits(reference, tokens, where)[where]
    np.testing.assert_array_equal(hf_logits(again, tokens, where)[where], expected)


def write_chat_jsonl(path: Path, num_records: int, *, seed: int = 0) -> Path:
    """`num_records` chat SFT records (`{"messages": [...]}`) of arithmetic, one per line."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(num_records):
            a, b = (int(x) for x in rng.integers(0, 50, size=2))
            messages = [
                {"role": "system", "content": "answer the question in one word."},
                {"role": "user", "content": f"what is {a} + {b}?"},
                {"role": "assistant", "content": f"the answer is {a + b}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def hf_greedy_with_images(
    model: Any, prompt: np.ndarray, images: dict, image_token: int, count: int
) -> np.ndarray:
    """`count` tokens a vision-language `model`'s `generate` decodes greedily after one
    prompt `[P]` whose image tokens are `image_token`, the images' arrays given by name
    (`pixel_values` and the family's own), with stop tokens off."""
    torch, _ = hf_modules()
    model.generation_config.eos_token_id = None  # all `count` tokens, as with no stop tokens
    with torch.no_grad():
        generated = model.generate(
            input_ids=torch.tensor(prompt[None], dtype=torch.long),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            **{name: torch.tensor(array) for name, array in images.items()},
            mm_token_type_ids=torch.tensor((prompt[None] == image_token).astype(np.int64)),
            max_new_tokens=count,
            do_sample=False,
        )
    return generated[0, len(prompt) :].numpy()


def hf_logits(model: Any, tokens: np.ndarray, where: np.ndarray) -> np.ndarray:
    """`model`'s logits with tunelib's default positions (real tokens counted): float32, or
    float64 for a float64 model."""
    torch, _ = hf_modules()
    positions = np.maximum(np.cumsum(where, axis=-1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(np.where(where, tokens, 0), dtype=torch.long),
            attention_mask=torch.tensor(where.astype(np.int64)),
            position_ids=torch.tensor(positions, dtype=torch.long),
        )
    logits = out.logits
    return (logits if logits.dtype == torch.float64 else logits.float()).numpy()


# A tiny Gemma 4 vision-language model: a 3-layer text stack (sliding, sliding, full, window
# 4, per-layer inputs, image tokens attending bidirectionally within an image on the sliding
# layers) and a 2-layer vision encoder (patches of 4 pixels pooled 2x2, grouped-query
# attention, clipped projections and standardised soft tokens).
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = 310, 311, 312
GEMMA4_VLM_TEXT = dict(
    {**COMMON, **FAMILIES["gemma4_text"]},
    num_hidden_layers=3,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    num_kv_shared_layers=0,
    use_bidirectional_attention="vision",
)
GEMMA4_VLM_VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    patch_size=4,
    pooling_kernel_size=2,
    position_embedding_size=16,
    use_clipped_linears=True,
    standardize=True,
    rope_parameters={"rope_type": "axial", "rope_theta": 50.0},
)
# `tunelib.data.gemma4_image_inputs` options for this encoder.
GEMMA4_VLM_PIXELS = dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=6)


def tiny_gemma4_vlm(*, seed: int = 0, **text_overrides: Any) -> Any:
    """A randomly initialised `Gemma4ForConditionalGeneration`, float32, eval mode.

    As `tiny_hf_model` does, norm scales and layer scalars are randomised; so are the vision
    tower's standardisation (bias and scale) and its clip bounds (finite, some binding), so
    that each changes the outputs.
    """
    torch, transformers = hf_modules()
    config = transformers.Gemma4Config(
        text_config={**GEMMA4_VLM_TEXT, **text_overrides},
        vision_config=GEMMA4_VLM_VISION,
        image_token_id=IMAGE_TOKEN,
        boi_token_id=BOI_TOKEN,
        eoi_token_id=EOI_TOKEN,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar") or name.endswith("std_scale"):
                buffer.copy_(1 + 0.3 * torch.randn_like(buffer))
            elif name.endswith("std_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
            elif name.endswith(("input_min", "output_min")):
                buffer.fill_(-1.0 - 2 * torch.rand(()).item())
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(1.0 + 2 * torch.rand(()).item())
    return model


# A tiny Qwen3.5 vision-language model: a Gated DeltaNet then a gated full-attention layer
# whose half-head RoPE is multimodal (interleaved sections 2, 1, 1 over its 4 pairs), and a
# 2-layer vision encoder (patches of 4 pixels, 2 frames, merged 2x2, a 4 x 4 position grid).
VISION_START_TOKEN, VISION_END_TOKEN, VIDEO_TOKEN = 311, 312, 313
QWEN3_5_VLM_TEXT = dict(
    {**COMMON, **FAMILIES["qwen3_5_text"]},
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
QWEN3_5_VLM_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=64,
    num_position_embeddings=16,
    initializer_range=0.3,
    rope_parameters={"rope_type": "axial", "rope_theta": 50.0},
)
# `tunelib.data.qwen_vl_image_inputs` options for this encoder.
QWEN3_5_VLM_PIXELS = dict(
    patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=32 * 32
)


def tiny_qwen3_5_vlm(*, seed: int = 0) -> Any:
    """A randomly initialised `Qwen3_5ForConditionalGeneration`, float32, eval mode, its norm
    scales and biases randomised (as `tiny_hf_model` does)."""
    torch, transformers = hf_modules()
    config = transformers.Qwen3_5Config(
        text_config=QWEN3_5_VLM_TEXT,
        vision_config=QWEN3_5_VLM_VISION,
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START_TOKEN,
        vision_end_token_id=VISION_END_TOKEN,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.3 * torch.randn_like(param))
    return model
