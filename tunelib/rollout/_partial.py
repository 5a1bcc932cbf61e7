"""Partial rollouts: completions sampled a segment at a time, each segment with the weights
of its moment, every token tagged with the policy version that drew it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Int, PyTree

from tunelib import _validation as v
from tunelib.rollout._decoding import Products
from tunelib.rollout._policy import check_version
from tunelib.rollout._sampler import Rollout, SamplingConfig, sample


def continue_rollout(
    graphdef: nnx.GraphDef,
    params: PyTree,
    prompt_tokens: Int[ArrayLike, "B P"],
    prompt_where: Bool[ArrayLike, "B P"],
    rollout: Rollout | None,
    key: jax.Array,
    config: SamplingConfig,
    *,
    steps: int,
    group_size: int = 1,
    policy_version: int | ArrayLike | None = None,
    products: Products = "blocked",
    windowed_cache: bool = True,
) -> Rollout:
    r"""Continue the unfinished completions of `rollout` by at most `steps` tokens with
    `params`, or start them (`rollout=None`): partial rollouts.

    A rollout worker that samples completions a segment at a time can take new weights
    between segments: the completions still running are continued by the new policy, and
    the finished ones are kept as they are. A completion is finished once it holds a stop
    token or `config.max_new_tokens` tokens (the whole budget, $N$). Continuing one, the
    prompt and the completion so far are prefilled as one prompt under `params` (the KV
    cache is recomputed, so the new tokens attend to keys and values of the weights that
    draw them: the cost of a prefill of $P + n$ positions per segment, against the decoding
    of up to `steps` tokens), then up to `steps` tokens are drawn by `sample`, as it draws
    them, from the last real token on. Token $t$ of a completion is drawn by the policy
    $\pi_{v_t}$ of the segment it fell in, and `logps[t]` is its log-prob under that policy:
    the behaviour log-probs of a partial rollout are per token, which is what the token-level
    importance ratios of `tunelib.losses` take,

    $$
    r_t = \frac{\pi_\theta(y_t \mid x, y_{<t})}{\pi_{v_t}(y_t \mid x, y_{<t})} .
    $$

    Given `policy_version`, each new token is tagged with it in `token_versions` (the tokens
    kept keep their tags), and the rollout is stamped with this call's version and the
    fingerprint of `params` (`tunelib.rollout.PolicyLedger` checks the newest policy);
    `oldest_versions` gives each completion's oldest tag, the one a staleness bound counts.

    Continued a segment at a time with the same weights and greedy decoding, the tokens are
    those of one `sample` call of $N$ tokens, up to the rounding by which a prefill and a
    cached decode step differ (float32: about 1e-6 in the log-probs). Sampled, a segment
    draws with its own `key` (pass a different one each segment).

    Args:
      graphdef: the `nnx.GraphDef` of a `tunelib.models.Decoder` (static).
      params: its parameters, as `sample` takes them (plain, or a base with LoRA adapters).
      prompt_tokens: `[B, P]` prompt token ids, as given to the first segment.
      prompt_where: `[B, P]` True on real prompt tokens.
      rollout: the completions so far, `[B * G, N]` with $N$ = `config.max_new_tokens`, as
        the previous segment returned them; None to start (no token yet).
      key: a PRNG key for this segment's draws.
      config: a `SamplingConfig` (static); `max_new_tokens` is the completions' whole budget
        $N$, and `cache_length` is not used (each segment's cache holds $P + N$ + `steps`
        slots).
      steps: the most tokens a completion gains in this segment, an int >= 1.
      group_size: completions per prompt, G: row `b * G + g` of `rollout` continues prompt
        b, as `sample(..., group_size=G)` lays them out.
      policy_version: the version of `params` (an int >= 0), or None (no tags, no stamp).
        Tags need it at every segment: a rollout that has them refuses a call without one.
      products: as in `sample`.
      windowed_cache: as in `sample`.

    Returns:
      A `Rollout` of `B * G` completions of $N$ slots: the finished ones as given, the others
      longer by what this segment drew; `truncated` is True where a completion used its
      whole budget without a stop token. With `policy_version`, `token_versions` is `[B * G,
      N]` int32, the version of each token inside `where` (and 0 outside it).

    Raises:
      ValueError: for a bad `steps` or `group_size`, a `rollout` of another shape than
        `[B * G, config.max_new_tokens]` or with recorded routing, and, with tags, a call
        without `policy_version`; `sample`'s errors otherwise.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from tunelib.models import Decoder, DecoderConfig
      >>> from tunelib.rollout import SamplingConfig, continue_rollout, oldest_versions
      >>> cfg = DecoderConfig(vocab_size=16, hidden_size=32, intermediate_size=64,
      ...                     num_hidden_layers=1, num_attention_heads=2, head_dim=16)
      >>> graphdef, old = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
      >>> _, new = nnx.split(Decoder(cfg, rngs=nnx.Rngs(1)))      # the weights after an update
      >>> prompts, where = jnp.array([[3, 4, 5]]), jnp.ones((1, 3), bool)
      >>> config = SamplingConfig(max_new_tokens=6, temperature=1.0)
      >>> part = continue_rollout(graphdef, old, prompts, where, None, jax.random.key(0),
      ...                         config, steps=2, policy_version=0)
      >>> out = continue_rollout(graphdef, new, prompts, where, part, jax.random.key(1),
      ...                        config, steps=4, policy_version=1)
      >>> print(out.token_versions.tolist(), out.lengths.tolist(), oldest_versions(out).tolist())
      [[0, 0, 1, 1, 1, 1]] [6] [0]

    References:
      Kimi Team, "Kimi k1.5: Scaling Reinforcement Learning with LLMs" (partial rollouts),
      2025, https://arxiv.org/abs/2501.12599.
      Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
      Language Reasoning" (interruptible generation, the cache recomputed under new
      weights), 2025, https://arxiv.org/abs/2505.24298.
    """
    v.static_int(steps, "steps")
    v.number_in(steps, "steps", low=1)
    v.static_int(group_size, "group_size")
    v.number_in(group_size, "group_size", low=1)
    check_version(policy_version)
    prompt_tokens, prompt_where = jnp.asarray(prompt_tokens), jnp.asarray(prompt_where)
    rows, budget = prompt_tokens.shape[0] * group_size, config.max_new_tokens
    if rollout is None:
        rollout = _empty(rows, budget, config)
    _check_partial(rollout, rows, budget, policy_version)
    if policy_version is not None and rollout.token_versions is None:  # the first tags
        rollout = rollout._replace(token_versions=_tags(rollout))
    # The prompt and the completion so far, as one prompt of P + N positions per row:
    # left-padded prompts, then the tokens drawn, then the budget's unused slots (padding).
    prompts = jnp.repeat(prompt_tokens, group_size, axis=0)
    prompts_where = jnp.repeat(prompt_where, group_size, axis=0)
    extended = jnp.concatenate([prompts, rollout.tokens], axis=1)
    extended_where = jnp.concatenate([prompts_where, rollout.where], axis=1)
    segment = dataclasses.replace(config, max_new_tokens=steps, cache_length=None)
    drawn = sample(
        graphdef, params, extended, extended_where, key, segment,
        policy_version=policy_version, products=products, windowed_cache=windowed_cache,
    )  # fmt: skip
    stops = jnp.asarray(config.stop_tokens, jnp.int32)
    version = None if policy_version is None else jnp.asarray(policy_version, jnp.int32)
    merged = _merge(rollout, drawn, stops, version)
    if policy_version is None:
        return merged
    return merged._replace(policy_version=drawn.policy_version, fingerprint=drawn.fingerprint)


def oldest_versions(rollout: Rollout) -> Int[Array, " B"]:
    """The oldest policy version among each completion's tokens (`Rollout.token_versions`
    inside `where`): what a bound on staleness counts for a partial rollout. A completion
    with no token yet has the rollout's own version.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.rollout import Rollout, oldest_versions
      >>> where = jnp.array([[True, True, False], [False, False, False]])
      >>> out = Rollout(jnp.zeros((2, 3), int), where, jnp.zeros((2, 3)), where.sum(-1),
      ...               jnp.array([False, False]), jnp.float32(1.0),
      ...               policy_version=jnp.int32(4), token_versions=jnp.array([[2, 4, 0]] * 2))
      >>> oldest_versions(out).tolist()
      [2, 4]
    """
    if rollout.token_versions is None or rollout.policy_version is None:
        raise ValueError(
            "oldest_versions needs a rollout with token_versions and policy_version: sample "
            "it with continue_rollout(..., policy_version=v)."
        )
    newest = jnp.asarray(rollout.policy_version, jnp.int32)
    return jnp.where(rollout.where, rollout.token_versions, newest).min(axis=-1)


def _empty(rows: int, budget: int, config: SamplingConfig) -> Rollout:
    """A rollout of `rows` completions with no token yet (and no tags: `_tags` adds them)."""
    return Rollout(
        jnp.full((rows, budget), config.pad_token, jnp.int32),
        jnp.zeros((rows, budget), bool),
        jnp.zeros((rows, budget), jnp.float32),
        jnp.zeros((rows,), jnp.int32),
        jnp.zeros((rows,), bool),
        jnp.asarray(config.temperature or 1.0, jnp.float32),
    )


def _check_partial(rollout: Rollout, rows: int, budget: int, policy_version) -> None:
    if not isinstance(rollout, Rollout):
        raise TypeError(f"rollout must be a Rollout or None, got {type(rollout).__name__}.")
    if tuple(rollout.tokens.shape) != (rows, budget):
        raise ValueError(
            f"rollout has completions of shape {tuple(rollout.tokens.shape)}; continuing "
            f"B * G = {rows} completions of max_new_tokens={budget} needs ({rows}, {budget})."
        )
    if rollout.routing is not None:
        raise ValueError(
            "continue_rollout does not continue recorded routing: sample a mixture of "
            "experts whose routing is replayed in one sample(..., record_routing=True) call."
        )
    stamped = rollout.token_versions is not None or rollout.policy_version is not None
    if stamped and policy_version is None:
        raise ValueError(
            "rollout is stamped with the policy versions that sampled it: give this "
            "segment's policy_version too."
        )


def _tags(rollout: Rollout) -> Int[Array, "B N"]:
    """The version tags of a rollout `sample` stamped (each token its one version), or of
    one with no token yet."""
    if rollout.policy_version is not None:
        return jnp.where(rollout.where, rollout.policy_version, 0).astype(jnp.int32)
    if not isinstance(rollout.where, jax.core.Tracer) and np.asarray(rollout.where).any():
        raise ValueError(
            "rollout has tokens but no policy version: sample its first segment with "
            "policy_version=v (or continue it without versions)."
        )
    return jnp.zeros(rollout.tokens.shape, jnp.int32)


@jax.jit
def _merge(rollout: Rollout, drawn: Rollout, stops, version) -> Rollout:
    """`rollout` with each unfinished completion extended by the tokens `drawn` for it."""
    budget, steps = rollout.tokens.shape[1], drawn.tokens.shape[1]
    lengths = rollout.lengths
    last = jnp.take_along_axis(rollout.tokens, jnp.maximum(lengths - 1, 0)[:, None], axis=1)
    stopped = (lengths > 0) & jnp.isin(last[:, 0], stops)
    running = ~stopped & (lengths < budget)
    slots = lengths[:, None] + jnp.arange(steps)  # where the drawn tokens go
    taken = drawn.where & running[:, None] & (slots < budget)
    slots = jnp.where(taken, slots, budget)  # an index past the end: dropped
    rows = jnp.arange(slots.shape[0])[:, None]

    def put(into, values):
        return into.at[rows, slots].set(values.astype(into.dtype), mode="drop")

    tokens, logps = put(rollout.tokens, drawn.tokens), put(rollout.logps, drawn.logps)
    lengths = lengths + taken.sum(axis=-1, dtype=jnp.int32)
    stopped = stopped | (taken & jnp.isin(drawn.tokens, stops)).any(axis=-1)
    versions = rollout.token_versions
    if version is not None:
        versions = put(versions, jnp.broadcast_to(version, drawn.tokens.shape))
    return rollout._replace(
        tokens=tokens,
        where=jnp.arange(budget) < lengths[:, None],
        logps=logps,
        lengths=lengths,
        truncated=~stopped & (lengths == budget),
        temperature=drawn.temperature,
        token_versions=versions,
    )
