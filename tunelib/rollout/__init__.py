"""Rollouts: logits processors, the KV-cache sampler, grouped sampling and weight sync.

`sample(graphdef, params, prompt_tokens, prompt_where, key, config)` generates completions
with the reference decoder's KV cache (`tunelib.models.Decoder.extend`) and returns a
`Rollout`: tokens, completion mask (stop token included), behaviour log-probs, lengths and
truncation flags. `completion_logps` scores completions under (possibly other) parameters, with
the shift from prompt to completion done once. `sync_weights` moves trained parameters onto a
rollout mesh.
"""

from tunelib.rollout._completion import completion_logps
from tunelib.rollout._processors import (
    check_sampling_args,
    forbid_tokens,
    min_p_filter,
    process_logits,
    temperature_scale,
    top_k_filter,
    top_p_filter,
)
from tunelib.rollout._sampler import Rollout, SamplingConfig, sample
from tunelib.rollout._sync import sync_weights

__all__ = [
    "Rollout",
    "SamplingConfig",
    "check_sampling_args",
    "completion_logps",
    "forbid_tokens",
    "min_p_filter",
    "process_logits",
    "sample",
    "sync_weights",
    "temperature_scale",
    "top_k_filter",
    "top_p_filter",
]
