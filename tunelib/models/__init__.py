"""The reference decoder (Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mistral / Gemma 2, 3, 4) in Flax NNX.

`Decoder(config, rngs=...)` maps token ids to final-norm hidden states; `unembed` and
`unembedding` turn them into logits separately, so that log-probs can be computed in chunks
without `[B, T, V]` logits. `DecoderConfig` uses the field names of a Hugging Face
`config.json`; `load_hf_checkpoint` and `save_hf_checkpoint` read and write Hugging Face
checkpoints (safetensors, one file or sharded) of the Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
Gemma 2, Gemma 3 and Gemma 4 families; `MoE`, `route` and `grouped_matmul` are its
mixture-of-experts layer; `read_gguf`, `convert_gguf` and `save_gguf` read and write
llama.cpp's GGUF files.
`PROJECTION_KERNELS` (the usual LoRA targets) and `hf_module_name` (the Hugging Face module of a
weight, as PEFT names it) name the decoder's weights for `tunelib.peft`.
"""

from tunelib.models._config import DecoderConfig
from tunelib.models._decoder import Decoder, KVCache
from tunelib.models._gguf import (
    GGUF_ARCHITECTURES,
    GGUF_TENSOR_TYPES,
    GGUFModel,
    GGUFTensor,
    convert_gguf,
    gguf_raw_tensors,
    gguf_tensors,
    load_gguf,
    read_gguf,
)
from tunelib.models._gguf_writer import save_gguf
from tunelib.models._grouped_matmul import (
    GROUPED_IMPLEMENTATIONS,
    grouped_matmul,
    grouped_matmul_p,
)
from tunelib.models._hf_checkpoint import (
    COPIED_FILES,
    HFCheckpoint,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from tunelib.models._hf_config import MODEL_TYPES, config_from_hf, config_to_hf
from tunelib.models._moe import MoE, route
from tunelib.models._names import PROJECTION_KERNELS, hf_module_name
from tunelib.models._rope import rope_frequencies
from tunelib.models._sharding import (
    EXPERT_PARALLEL_RULES,
    TENSOR_PARALLEL_RULES,
    param_shardings,
)

__all__ = [
    "COPIED_FILES",
    "EXPERT_PARALLEL_RULES",
    "GGUF_ARCHITECTURES",
    "GGUF_TENSOR_TYPES",
    "GROUPED_IMPLEMENTATIONS",
    "MODEL_TYPES",
    "PROJECTION_KERNELS",
    "TENSOR_PARALLEL_RULES",
    "Decoder",
    "DecoderConfig",
    "GGUFModel",
    "GGUFTensor",
    "HFCheckpoint",
    "KVCache",
    "MoE",
    "config_from_hf",
    "config_to_hf",
    "convert_gguf",
    "gguf_raw_tensors",
    "gguf_tensors",
    "grouped_matmul",
    "grouped_matmul_p",
    "hf_module_name",
    "load_gguf",
    "load_hf_checkpoint",
    "param_shardings",
    "read_gguf",
    "rope_frequencies",
    "route",
    "save_gguf",
    "save_hf_checkpoint",
]
