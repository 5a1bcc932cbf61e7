"""Everything on the vocabulary axis: per-token log-probs, entropy and divergences, and
masked sequence reductions.

Everything downstream (losses, advantages, aggregation) sees the vocabulary only through what
this package computes, in float32 whatever the input dtype: from logits (`token_logps`,
`token_entropy`, `token_divergence`) or, without ever forming the `[N, V]` logits, from hidden
states and the unembedding (`fused_token_logps`, `fused_divergence`).
"""

from tunelib.logprobs._divergence import DIVERGENCES, token_divergence
from tunelib.logprobs._fused import IMPLEMENTATIONS, fused_token_logps
from tunelib.logprobs._fused_divergence import fused_divergence
from tunelib.logprobs._sequence import sequence_mean, sequence_sum
from tunelib.logprobs._tiles import default_chunk_size
from tunelib.logprobs._token import token_entropy, token_logps

__all__ = [
    "DIVERGENCES",
    "IMPLEMENTATIONS",
    "default_chunk_size",
    "fused_divergence",
    "fused_token_logps",
    "sequence_mean",
    "sequence_sum",
    "token_divergence",
    "token_entropy",
    "token_logps",
]
