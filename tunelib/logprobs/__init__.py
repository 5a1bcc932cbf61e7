"""Per-token log-probabilities, entropy and masked sequence reductions.

Everything downstream (losses, advantages, aggregation) sees the vocabulary only through what
this package computes from logits, in float32 whatever the input dtype.
"""

from tunelib.logprobs._fused import IMPLEMENTATIONS, fused_token_logps
from tunelib.logprobs._sequence import sequence_mean, sequence_sum
from tunelib.logprobs._token import token_entropy, token_logps

__all__ = [
    "IMPLEMENTATIONS",
    "fused_token_logps",
    "sequence_mean",
    "sequence_sum",
    "token_entropy",
    "token_logps",
]
