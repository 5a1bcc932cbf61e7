"""The names of the decoder's weights that other tools need: LoRA targets, PEFT module names."""

PROJECTION_KERNELS = r"layers/.*_proj(_[a-z]+)*/kernel"
"""A regular expression for the path of every attention and MLP projection kernel of a
`Decoder` (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`,
DeepSeek-V3's latent attention's `q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`,
and a Gated DeltaNet's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `out_proj`),
with stacked layers (`layers/self_attn/q_proj/kernel`) or not (`layers/0/...`): the usual LoRA
and QLoRA targets, as in `tunelib.peft.LoraRule(pattern=PROJECTION_KERNELS)`. The embedding,
norms, biases and `lm_head` are left out."""


def hf_module_name(path: str) -> str:
    """The Hugging Face module of a `tunelib.models.Decoder` weight path.

    The module is what Hugging Face PEFT's `target_modules` and adapter tensor names refer
    to: the weight's own name is dropped, and everything but `lm_head` lives under `model.`
    (see the table of weights in `docs/models.md`). A path of stacked layers has no layer
    index; give one (`layers/3/...`) to name a single layer's module.

    Args:
      path: a `/`-joined parameter path, as `tunelib.peft` rules match it.

    Returns:
      The dotted Hugging Face module name.

    Examples:
      >>> from tunelib.models import hf_module_name
      >>> hf_module_name("layers/3/self_attn/q_proj/kernel")
      'model.layers.3.self_attn.q_proj'
      >>> hf_module_name("lm_head/kernel")
      'lm_head'
    """
    *modules, _ = path.split("/")
    name = ".".join(modules)
    return name if modules[0] == "lm_head" else "model." + name
