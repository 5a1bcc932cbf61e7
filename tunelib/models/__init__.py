"""The reference decoder (Llama / Qwen2 / Qwen3 / Mistral family) in Flax NNX.

`Decoder(config, rngs=...)` maps token ids to final-norm hidden states; `unembed` and
`unembedding` turn them into logits separately, so that log-probs can be computed in chunks
without `[B, T, V]` logits. `DecoderConfig` uses the field names of a Hugging Face
`config.json`.
"""

from tunelib.models._config import DecoderConfig
from tunelib.models._decoder import Decoder, KVCache
from tunelib.models._rope import rope_frequencies
from tunelib.models._sharding import TENSOR_PARALLEL_RULES, param_shardings

__all__ = [
    "TENSOR_PARALLEL_RULES",
    "Decoder",
    "DecoderConfig",
    "KVCache",
    "param_shardings",
    "rope_frequencies",
]
