"""Rollouts: logits processors, the KV-cache sampler, grouped sampling, multi-turn episodes and
environments, and weight sync.

`sample(graphdef, params, prompt_tokens, prompt_where, key, config)` generates completions
with the reference decoder's KV cache (`tunelib.models.Decoder.extend`) and returns a
`Rollout`: tokens, completion mask (stop token included), behaviour log-probs, lengths and
truncation flags. `SamplingConfig.from_tokenizer` takes a tokenizer's stop and pad ids, and
`Rollout.decode` gives the completions' texts. Both `sample` and `run_episodes` take a base
with LoRA adapters (`tunelib.peft.apply_lora`, the base float or quantised) and sample on it
without merging. `completion_logps` scores completions under (possibly other) parameters, with
the shift from prompt to completion done once. `sync_weights` moves trained parameters onto a
rollout mesh; `weight_delta` and `apply_weight_delta` send only the elements an update
changed.

Which policy sampled a rollout: given `policy_version=`, `sample` and `run_episodes` stamp their
output with it and with `fingerprint(params)` of the parameters they ran; a trainer's
`PolicyLedger` records the fingerprint of each version it hands out and checks a rollout's
stamp before training on it (`StalePolicyError` when the sampler ran something else).
Partial rollouts: `continue_rollout` samples completions a segment at a time, each segment
with the weights of its moment (the unfinished completions continued by the new policy), and
tags every token with the version that drew it; `oldest_versions` is what a staleness bound
counts.

Multi-turn episodes: `run_episodes` alternates model turns and the observations of host-side
`Environment`s in one KV cache and returns an `Episode` (tokens as sampled and observed,
roles, behaviour log-probs, turn boundaries and rewards); `episode_advantages` and
`turn_advantages` spread group-relative advantages over its tokens. Tools: `parse_tool_calls`
reads Hermes / Qwen `<tool_call>` blocks, `tool_response_tokens` renders tool messages with a
chat template, and `ToolEnvironment` with the `CALCULATOR` tool is a ready environment.
"""

from tunelib.rollout._completion import completion_logps
from tunelib.rollout._environments import Environment, Step, Turn
from tunelib.rollout._episode_advantages import CREDITS, episode_advantages, turn_advantages
from tunelib.rollout._episodes import Episode, EpisodeConfig, Role, run_episodes
from tunelib.rollout._partial import continue_rollout, oldest_versions
from tunelib.rollout._policy import PolicyLedger, StalePolicyError, fingerprint
from tunelib.rollout._processors import (
    check_sampling_args,
    forbid_tokens,
    min_p_filter,
    process_logits,
    temperature_scale,
    top_k_filter,
    top_p_filter,
)
from tunelib.rollout._sampler import NoStopTokenWarning, Rollout, SamplingConfig, sample
from tunelib.rollout._sync import sync_weights
from tunelib.rollout._tool_calls import (
    CALCULATOR,
    Tool,
    ToolCall,
    ToolEnvironment,
    calculator,
    parse_tool_calls,
    tool_response_tokens,
)
from tunelib.rollout._weight_delta import WeightDelta, apply_weight_delta, weight_delta

__all__ = [
    "CALCULATOR",
    "CREDITS",
    "Environment",
    "Episode",
    "EpisodeConfig",
    "NoStopTokenWarning",
    "PolicyLedger",
    "Role",
    "Rollout",
    "SamplingConfig",
    "StalePolicyError",
    "Step",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "Turn",
    "WeightDelta",
    "apply_weight_delta",
    "calculator",
    "check_sampling_args",
    "completion_logps",
    "continue_rollout",
    "episode_advantages",
    "fingerprint",
    "forbid_tokens",
    "min_p_filter",
    "oldest_versions",
    "parse_tool_calls",
    "process_logits",
    "run_episodes",
    "sample",
    "sync_weights",
    "temperature_scale",
    "tool_response_tokens",
    "top_k_filter",
    "top_p_filter",
    "turn_advantages",
    "weight_delta",
]
