"""The reference decoder (Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mistral / Gemma 2, 3, 4 / gpt-oss /
DeepSeek-V3 / Qwen3.5) in Flax NNX.

`Decoder(config, rngs=...)` maps token ids to final-norm hidden states; `unembed` and
`unembedding` turn them into logits separately, so that log-probs can be computed in chunks
without `[B, T, V]` logits. `DecoderConfig` uses the field names of a Hugging Face
`config.json` (`tunelib.formats` reads and writes Hugging Face checkpoints and GGUF files);
`MoE`, `route` and `grouped_matmul` are its mixture-of-experts layer, `route_grouped` and
`expert_bias_update` DeepSeek-V3's routing and its balancing rule; `GatedDeltaNet` is
Qwen3.5's linear-attention layer, `chunked_gated_delta_rule`, `recurrent_gated_delta_rule`,
`causal_conv1d`, `gated_rms_norm` and `unit_lower_inverse` its pure functions;
`VisionLanguageModel` puts Gemma 4's vision encoder (`VisionEncoder`, `VisionConfig`) and
multimodal embedder (`MultimodalEmbedder`), or Qwen3.5's encoder and merger (`QwenVisionEncoder`,
`QwenVisionConfig`), in front of it, the images' soft tokens at the image tokens (Qwen3.5's
at the 3-D positions of `mrope_positions`);
`param_shardings` and the rules place its parameters on a mesh. `ROPE_PARAMETERS` names the
parameters of each RoPE type that `DecoderConfig.rope_scaling` holds (`rope_frequencies`
computes them).
`PROJECTION_KERNELS` (the usual LoRA targets) and `hf_module_name` (the Hugging Face module of a
weight, as PEFT names it) name the decoder's weights for `tunelib.peft`.
"""

from tunelib._deprecation import moved_names
from tunelib.models._config import DTYPE_NAMES, DecoderConfig
from tunelib.models._decoder import Decoder, KVCache
from tunelib.models._deepseek_moe import expert_bias_update, route_grouped
from tunelib.models._delta_net import (
    causal_conv1d,
    chunked_gated_delta_rule,
    gated_rms_norm,
    recurrent_gated_delta_rule,
    unit_lower_inverse,
)
from tunelib.models._gated_delta_net import GatedDeltaNet
from tunelib.models._grouped_matmul import (
    GROUPED_IMPLEMENTATIONS,
    grouped_matmul,
    grouped_matmul_p,
)
from tunelib.models._moe import MoE, route
from tunelib.models._mrope import mrope_positions
from tunelib.models._names import PROJECTION_KERNELS, hf_module_name
from tunelib.models._qwen_vision import QwenVisionEncoder
from tunelib.models._qwen_vision_config import QwenVisionConfig
from tunelib.models._rope import ROPE_PARAMETERS, rope_frequencies
from tunelib.models._sharding import (
    EXPERT_PARALLEL_RULES,
    TENSOR_PARALLEL_RULES,
    param_shardings,
)
from tunelib.models._vision import MultimodalEmbedder, VisionEncoder
from tunelib.models._vision_config import VisionConfig
from tunelib.models._vision_language import VisionLanguageModel

__all__ = [
    "DTYPE_NAMES",
    "EXPERT_PARALLEL_RULES",
    "GROUPED_IMPLEMENTATIONS",
    "PROJECTION_KERNELS",
    "ROPE_PARAMETERS",
    "TENSOR_PARALLEL_RULES",
    "Decoder",
    "DecoderConfig",
    "GatedDeltaNet",
    "KVCache",
    "MoE",
    "MultimodalEmbedder",
    "QwenVisionConfig",
    "QwenVisionEncoder",
    "VisionConfig",
    "VisionEncoder",
    "VisionLanguageModel",
    "causal_conv1d",
    "chunked_gated_delta_rule",
    "expert_bias_update",
    "gated_rms_norm",
    "grouped_matmul",
    "grouped_matmul_p",
    "hf_module_name",
    "mrope_positions",
    "param_shardings",
    "recurrent_gated_delta_rule",
    "rope_frequencies",
    "route",
    "route_grouped",
    "unit_lower_inverse",
]

# The Hugging Face and GGUF formats moved to `tunelib.formats`; served from here until 0.3.0.
__getattr__ = moved_names(
    __name__,
    {
        name: ("tunelib.formats", name)
        for name in (
            "COPIED_FILES",
            "GGUF_ARCHITECTURES",
            "GGUF_TENSOR_TYPES",
            "MODEL_TYPES",
            "GGUFModel",
            "GGUFTensor",
            "HFCheckpoint",
            "config_from_hf",
            "config_to_hf",
            "convert_gguf",
            "gguf_raw_tensors",
            "gguf_tensors",
            "load_gguf",
            "load_hf_checkpoint",
            "read_gguf",
            "save_gguf",
            "save_hf_checkpoint",
        )
    },
)
