"""The reference decoder (Llama / Qwen2 / Qwen3 / Mistral family) in Flax NNX.

`Decoder(config, rngs=...)` maps token ids to final-norm hidden states; `unembed` and
`unembedding` turn them into logits separately, so that log-probs can be computed in chunks
without `[B, T, V]` logits. `DecoderConfig` uses the field names of a Hugging Face
`config.json`.
"""

from tunelib.models._config import DecoderConfig
from tunelib.models._decoder import Decoder
from tunelib.models._rope import rope_frequencies

__all__ = [
    "Decoder",
    "DecoderConfig",
    "rope_frequencies",
]
