"""Multi-turn episodes: the model's turns and the environments' observations in one KV cache."""

import dataclasses
import enum
import functools
import logging
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int, PyTree

from tunelib import _validation as v
from tunelib.data import Tokenizer
from tunelib.rollout._compiled import program
from tunelib.rollout._decoding import (
    LAYOUTS,
    PRODUCTS,
    Layout,
    Products,
    as_key,
    check_record_routing,
    checked_prompts,
    decode,
    decoding_params,
    last_logits,
    prefill,
    products_context,
)
from tunelib.rollout._environments import Environment, Turn, call_all
from tunelib.rollout._policy import check_version, stamp
from tunelib.rollout._sampler import Rollout, SamplingConfig

_logger = logging.getLogger(__name__)


class Role(enum.IntEnum):
    """What each position of an `Episode` holds (`Episode.roles`)."""

    PADDING = 0
    MODEL = 1
    OBSERVATION = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeConfig:
    """How `run_episodes` runs multi-turn episodes. Every field is checked when it is made.

    Attributes:
      sampling: the `SamplingConfig` of each model turn: its `max_new_tokens` is the most
        tokens of one turn, its `stop_tokens` end a turn (the stop token stays in the turn),
        and the temperature, filters, `pad_token` and `logps_of` mean what they mean for
        `sample`. Its `cache_length` must be None (the episode's cache is `cache_length`
        below).
      max_turns: the most model turns per episode, $K \\ge 1$.
      max_tokens: the token budget of an episode after its prompt, model and observation
        tokens together, $T \\ge 1$: the width of the `Episode` arrays.
      max_observation_tokens: the most tokens of one observation, $O \\ge 1$: each
        observation is written into the cache as a `[B, O]` block (shorter ones padded).
      turn_end_sequences: token-id sequences that also end a turn once the model has
        sampled them in that turn, such as the ids of a closing tag `</tool_call>` (one
        token or several); the sequence stays in the turn.
      cache_length: KV-cache slots; None (default) means the most an episode can use,
        $P + K N + (K - 1) O$ for prompts of $P$ positions and turns of $N$ =
        `sampling.max_new_tokens` tokens. Every decode step takes one slot for every row and
        every observation $O$ slots, so a smaller cache can end episodes early (they are
        then `truncated`).
      step_timeout: seconds an environment's `reset` or `step` may take (> 0), or None for
        no limit. A row whose environment runs longer, raises or answers something that is
        not a valid `Step` ends with zero reward and its `failed` flag.
    """

    sampling: SamplingConfig
    max_turns: int
    max_tokens: int
    max_observation_tokens: int
    turn_end_sequences: tuple[tuple[int, ...], ...] = ()
    cache_length: int | None = None
    step_timeout: float | int | None = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {self.sampling!r}.")
        if self.sampling.cache_length is not None:
            raise ValueError(
                f"sampling.cache_length must be None, got {self.sampling.cache_length}; an "
                "episode's cache is EpisodeConfig.cache_length."
            )
        for name in ("max_turns", "max_tokens", "max_observation_tokens"):
            v.static_int(getattr(self, name), name)
            v.number_in(getattr(self, name), name, low=1)
        sequences = self.turn_end_sequences
        if isinstance(sequences, str) or not isinstance(sequences, Sequence):
            raise TypeError(
                f"turn_end_sequences must be a tuple of tuples of token ids, got {sequences!r}."
            )
        sequences = tuple(v.token_id_tuple(s, "turn_end_sequences") for s in sequences)
        if any(not s for s in sequences):
            raise ValueError(f"turn_end_sequences holds an empty sequence: {sequences!r}.")
        if self.cache_length is not None:
            v.static_int(self.cache_length, "cache_length")
            v.number_in(self.cache_length, "cache_length", low=2)
        if self.step_timeout is not None:
            v.real_number(self.step_timeout, "step_timeout")
            v.number_in(self.step_timeout, "step_timeout", low=0, low_open=True)
            v.finite_number(self.step_timeout, "step_timeout")
        normalized = {
            "max_turns": int(self.max_turns),
            "max_tokens": int(self.max_tokens),
            "max_observation_tokens": int(self.max_observation_tokens),
            "turn_end_sequences": sequences,
            "cache_length": None if self.cache_length is None else int(self.cache_length),
            "step_timeout": None if self.step_timeout is None else float(self.step_timeout),
        }
        for name, value in normalized.items():
            object.__setattr__(self, name, value)


# An Episode has a Rollout's arrays, over the episode's T positions (N = T in their
# annotations), then its own, then a Rollout's policy stamp, then its MoE routing (last, so
# that the fields before it keep their places). Episodes are sampled in one call: no
# per-token versions (`continue_rollout`'s).
_STAMP = ("policy_version", "fingerprint")
_NOT_ITS_OWN = (*_STAMP, "routing", "token_versions")
_EpisodeFields = NamedTuple(
    "_EpisodeFields",
    [
        *((k, t) for k, t in Rollout.__annotations__.items() if k not in _NOT_ITS_OWN),
        ("roles", Int[Array, "B T"]),
        ("context_where", Bool[Array, "B T"]),
        ("turn_ids", Int[Array, "B T"]),
        ("turn_starts", Int[Array, "B K"]),
        ("turn_ends", Int[Array, "B K"]),
        ("turn_rewards", Float[Array, "B K"]),
        ("rewards", Float[Array, " B"]),
        ("num_turns", Int[Array, " B"]),
        ("failed", Bool[Array, " B"]),
        *((k, Rollout.__annotations__[k]) for k in _STAMP),
        ("routing", Int[Array, "B PT M k"] | None),
    ],
)
# The stamp is None unless `run_episodes` was given a policy version, as a Rollout's; the
# routing is None unless it recorded it.
_EpisodeFields.__new__.__defaults__ = (None,) * (len(_STAMP) + 1)


class Episode(_EpisodeFields):
    """Multi-turn episodes from `run_episodes`, one row per episode, in one padded `[B, T]`
    layout after the prompt: the model's turns and the observations between them, in order,
    then padding. A pytree of arrays (every field but the scalar `temperature` has a row per
    episode).

    It has the six arrays of a `Rollout`, meaning what they mean there for the model's
    tokens (with observations in `tokens` and `lengths` too), then nine of its own, then a
    `Rollout`'s policy stamp, then, recorded, its MoE routing.

    Attributes:
      tokens: `[B, T]` token ids, exactly as sampled (model turns) and as observed
        (observations); `sampling.pad_token` on padding.
      where: `[B, T]` True on model tokens, `roles == Role.MODEL`: the mask of the loss, the
        KL and the entropy. Observation tokens are never trained on.
      logps: `[B, T]` float32 behaviour log-probs of model tokens (as `Rollout.logps`), 0
        elsewhere.
      lengths: `[B]` int32 positions used, `context_where.sum(-1)`.
      truncated: `[B]` True where the episode hit a limit (`max_turns`, `max_tokens`, the
        cache, or an observation longer than `max_observation_tokens` or the budget left)
        before its environment said done.
      temperature: float32 scalar, the temperature of `logps` (as `Rollout.temperature`).
      roles: `[B, T]` int8 `Role` of each position: `MODEL`, `OBSERVATION` or `PADDING`.
      context_where: `[B, T]` True on model and observation tokens, `roles != Role.PADDING`:
        what the model attends to, the mask to score the episode with (`completion_logps`).
      turn_ids: `[B, T]` int32 turn `k` of each token (a turn's model tokens and the
        observation that answers them), -1 on padding.
      turn_starts: `[B, K]` int32 first position of each model turn; 0 for turns that did
        not happen.
      turn_ends: `[B, K]` int32 position after each model turn's last token (its observation
        runs from there to the next turn's start); 0 for turns that did not happen.
      turn_rewards: `[B, K]` float32 reward of each turn (0 for turns that did not happen
        and on failed rows).
      rewards: `[B]` float32 episode (outcome) reward, the sum of its turn rewards.
      num_turns: `[B]` int32 model turns taken.
      failed: `[B]` True where the environment raised, timed out or answered an invalid
        `Step`: the episode ended there and its rewards are 0.
      policy_version: int32 scalar, `run_episodes`'s `policy_version=` (None without it).
      fingerprint: uint32 scalar, `tunelib.rollout.fingerprint` of the parameters the
        episodes ran, with `policy_version` (None without it).
      routing: with `run_episodes(..., record_routing=True)`, the `[B, P + T, M, k]` int32
        experts each token was routed to in each of the model's M mixture-of-experts layers,
        over the prompt and the episode concatenated, as `Rollout.routing` is over a prompt
        and a completion: columns `[0, P)` are the prompt's (its prefill, the same for the G
        episodes of a prompt), column `P + t` is the episode's position `t`, a model token
        (as the decode step that fed it back chose) or an observation token (as the
        observation's prefill into the cache chose). Padded positions hold valid ids that
        no real token depends on. `completion_logps(..., prompt_tokens, prompt_where, ep.tokens,
        ep.context_where, routing=ep.routing)` routes the trainer's forward pass by it
        (R3); a batch cut to its first `T'` positions takes `routing[:, :P + T']`. None (the
        default) when not recorded.
    """

    __slots__ = ()


def run_episodes(
    graphdef: nnx.GraphDef,
    params: PyTree,
    prompt_tokens: Int[ArrayLike, "B P"],
    prompt_where: Bool[ArrayLike, "B P"],
    key: jax.Array,
    config: EpisodeConfig,
    environments: Sequence[Environment],
    *,
    group_size: int = 1,
    tokenizer: Tokenizer | None = None,
    policy_version: int | ArrayLike | None = None,
    layout: Layout = "stacked",
    products: Products = "blocked",
    record_routing: bool = False,
) -> Episode:
    r"""Run multi-turn episodes: model turns and environment observations in one KV cache.

    Each row alternates model turns and observations until its environment says done:

    $$
    x \;\to\; y^{(1)} \;\to\; o^{(1)} \;\to\; y^{(2)} \;\to\; o^{(2)} \;\to\; \cdots
    \;\to\; y^{(k)}, \qquad y^{(j)}_t \sim \pi_\theta\big(\cdot \mid x, y^{(1)}, o^{(1)},
    \dots, y^{(j)}_{<t}\big),
    $$

    with $x$ = the row's prompt, $y^{(j)}$ its $j$-th model turn and $o^{(j)}$ the $j$-th
    observation, the tokens of `environments[r].step` answering turn $j$. The prompts are
    prefilled once (forked `group_size` ways, as `sample` does). A turn is one jitted
    `lax.while_loop` of `sample`'s decode step that continues every row from its cache and
    ends once every row's turn is over: by a stop token, by a `turn_end_sequences` match, or
    by a limit. The environments then step on the host, in threads, each under
    `config.step_timeout`. Each observation is written into the same cache by one jitted
    `Decoder.extend` of a `[B, O]` block, so the history is never prefilled again and its
    tokens are never re-tokenized. Rows at different lengths share the cache's slot index:
    a row that waits (its turn ended early, or its observation is shorter than $O$) fills
    padding slots that no query sees, and its RoPE positions count only its real tokens, so
    the model sees what one forward pass over the row's prompt and episode gives it.

    An episode ends when its environment's `Step` says done, after `max_turns` turns, when
    its `max_tokens` budget or the cache is used up, or when its observation does not fit
    (longer than `max_observation_tokens`, or leaving no token of budget for a next turn);
    the limits mark it `truncated`. Turn $j$ draws with `fold_in(fold_in(key, j), t)` at
    step $t$: the same key and environments reproduce a call.

    Cost: the batch's shapes are static, so every decode step runs all $B$ rows, finished
    ones too (their slots are padding), and a turn lasts as long as its longest row: a
    batch costs about $B \sum_j \max_r |y^{(j)}_r|$ decode-token steps plus $B\,O$ tokens per
    observation, however early some episodes end; the device waits while the environments
    step.

    Args:
      graphdef: the `nnx.GraphDef` of a `tunelib.models.Decoder` (static).
      params: its parameters (an `nnx.State` or the pure dict of one), or a base with LoRA
        adapters (`tunelib.peft.apply_lora`, as `sample` takes them): the jitted turns then
        run through `peft.lora`. (`peft.lora(run_episodes)` cannot work: the environments
        step on the host between turns, on concrete arrays.)
      prompt_tokens: `[B, P]` prompt token ids, concrete (the turns run from the host).
      prompt_where: `[B, P]` True on real prompt tokens; each prompt needs one at least.
      key: a PRNG key.
      config: an `EpisodeConfig`.
      environments: `B * G` environments, one per row (row `b * G + g` is episode `g` of
        prompt `b`); each is `reset` with its row's real prompt ids.
      group_size: episodes per prompt, G >= 1.
      tokenizer: optional; decodes each `Turn.text` and encodes text observations.
      policy_version: the version of the policy `params` are, or None; given, the `Episode`
        is stamped with it and the fingerprint of `params`, as `sample` stamps a `Rollout`.
      layout: ``"stacked"`` (default) or ``"per_layer"``, as for `sample`.
      products: ``"blocked"`` (default) or ``"plain"`` float32 products on CPU, as for
        `sample`.
      record_routing: record the experts every token of the prompt and the episode was
        routed to in each mixture-of-experts layer, as `Episode.routing` (default False),
        for routing replay (R3) in the trainer's recomputation, as `sample`'s: the model's
        tokens as its decode steps routed them, the observations' as their prefill did.

    Returns:
      An `Episode` of `B * G` rows, `config.max_tokens` positions and `config.max_turns`
      turns.

    Raises:
      ValueError: before compiling, for the checks of `sample` (`record_routing` for a model
        without mixture-of-experts layers among them), a cache too short for the
        prompts, a number of environments other than `B * G`, prompts that are traced or
        spread over several processes, or a model with sliding-window layers whose window
        is shorter than the cache (waiting rows put padding slots inside the window, which
        would then hold fewer real tokens than in one pass over the episode).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from tunelib.models import Decoder, DecoderConfig
      >>> from tunelib.rollout import (EpisodeConfig, Role, SamplingConfig, Step,
      ...                              run_episodes)
      >>> cfg = DecoderConfig(vocab_size=16, hidden_size=32, intermediate_size=64,
      ...                     num_hidden_layers=1, num_attention_heads=2, head_dim=16)
      >>> graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
      >>> class Echo:  # answers each turn with its last token; done after three turns
      ...     def reset(self, prompt):
      ...         self.turns = 0
      ...     def step(self, turn):
      ...         self.turns += 1
      ...         return Step(turn.tokens[-1:], float(self.turns), self.turns == 3)
      >>> config = EpisodeConfig(
      ...     sampling=SamplingConfig(max_new_tokens=4, temperature=1.0, stop_tokens=(2,)),
      ...     max_turns=3, max_tokens=20, max_observation_tokens=2)
      >>> prompts = jnp.array([[0, 3, 4], [5, 6, 7]])
      >>> prompt_where = jnp.array([[False, True, True], [True, True, True]])
      >>> ep = run_episodes(graphdef, params, prompts, prompt_where, jax.random.key(0),
      ...                   config, [Echo() for _ in range(4)], group_size=2)
      >>> print(ep.tokens.shape, ep.turn_rewards.shape, ep.num_turns, ep.rewards)
      (4, 20) (4, 3) [3 3 3 3] [6. 6. 6. 6.]
      >>> bool((ep.where == (ep.roles == Role.MODEL)).all())
      True
      >>> print(int((ep.roles == Role.OBSERVATION).sum()))  # one token after turns 1 and 2
      8

    References:
      Zhou et al., "ArCHer: Training Language Model Agents via Hierarchical Multi-Turn RL",
      2024, https://arxiv.org/abs/2402.19446.
      Pope et al., "Efficiently Scaling Transformer Inference" (KV caching), 2022,
      https://arxiv.org/abs/2211.05102.
    """
    if not isinstance(config, EpisodeConfig):
        raise TypeError(f"config must be an EpisodeConfig, got {type(config).__name__}.")
    prompt_tokens, prompt_where, model_config = checked_prompts(
        graphdef, params, prompt_tokens, prompt_where, config.sampling, group_size
    )
    environments = list(environments)
    _check_rows(prompt_tokens, prompt_where, len(environments), group_size)
    slots = _cache_slots(config, prompt_tokens.shape[1], model_config)
    check_version(policy_version)
    v.one_of(layout, "layout", LAYOUTS)
    v.one_of(products, "products", PRODUCTS)
    check_record_routing(record_routing, model_config)
    given, params, key = params, decoding_params(graphdef, params, layout), as_key(key)
    run = _Run(environments, config, model_config.vocab_size, tokenizer)
    with products_context(products):
        _episodes(run, graphdef, params, prompt_tokens, prompt_where, key, group_size, slots,
                  record_routing)  # fmt: skip
    episode = run.episode()
    return episode if policy_version is None else episode._replace(**stamp(given, policy_version))


def _episodes(run, graphdef, params, prompt_tokens, prompt_where, key, group_size, slots,
              record) -> None:  # fmt: skip
    """`run_episodes` after its checks: the prefill, then the turns and observations of
    `run` (a `_Run`), which records them."""
    config = run.config
    logits, cache, *routed = _start(graphdef, params, prompt_tokens, prompt_where, slots,
                                    group_size, record)  # fmt: skip
    if record:
        run.record_prompts(np.asarray(routed[0]))
    run.reset(_row_prompts(prompt_tokens, prompt_where, group_size))
    for turn in range(config.max_turns):
        limit = run.limits(slots - int(cache.index))
        if not run.active.any():
            break
        out = _turn(graphdef, params, logits, cache, jax.random.fold_in(key, turn),
                    config.sampling, config.turn_end_sequences, ~run.active, limit,
                    record)  # fmt: skip
        logits, cache = out.logits, out.cache
        drawn = jax.device_get((out.tokens, out.where, out.logps, out.ended, out.routing))
        observations = run.step(turn, *drawn)
        block = run.observe(turn, observations, room=slots - int(cache.index))
        if block is not None:
            logits, cache, *routed = _observe(graphdef, params, logits, cache, *block, record)
            if record:
                run.record_observations(np.asarray(routed[0]), block[1])


def _check_rows(
    prompt_tokens: jax.Array, prompt_where: jax.Array, environments: int, group_size: int
) -> None:
    """The prompts are concrete and in this process, with one environment for each of their
    `B * G` rows."""
    if isinstance(prompt_tokens, jax.core.Tracer) or isinstance(prompt_where, jax.core.Tracer):
        raise ValueError(
            "prompt_tokens and prompt_where must be concrete arrays: run_episodes steps "
            "environments on the host between jitted turns, so it cannot run under jax.jit."
        )
    for name, x in (("prompt_tokens", prompt_tokens), ("prompt_where", prompt_where)):
        if not x.is_fully_addressable:
            raise ValueError(f"{name} is spread over several processes; run_episodes needs "
                             "every row in this process.")  # fmt: skip
    batch = prompt_tokens.shape[0]
    if environments != batch * group_size:
        raise ValueError(
            f"environments must hold one environment per row, B * G = {batch} * {group_size} "
            f"= {batch * group_size}, got {environments}."
        )


def _cache_slots(config: EpisodeConfig, prompt_len: int, model_config) -> int:
    """The episode's KV-cache slots, checked against the prompts and the model's window."""
    turns, new = config.max_turns, config.sampling.max_new_tokens
    slots = config.cache_length or (
        prompt_len + turns * new + (turns - 1) * config.max_observation_tokens
    )
    if slots <= prompt_len:
        raise ValueError(
            f"cache_length {slots} leaves no slot after prompts of {prompt_len} positions."
        )
    window = model_config.sliding_window
    if any(model_config.sliding_layers) and window is not None and window < slots:
        raise ValueError(
            f"the model has sliding-window layers (sliding_window={window}) and the episode's "
            f"cache has {slots} slots: rows that wait put padding slots inside the window, "
            "so it would see fewer real tokens than a forward pass over the episode. Use a "
            "cache_length of at most the window."
        )
    return slots


def _row_prompts(prompt_tokens: jax.Array, prompt_where: jax.Array, group_size: int) -> list:
    """Each row's real prompt ids, a tuple of ints (row `b * G + g` has prompt `b`'s)."""
    tokens, where = np.asarray(prompt_tokens), np.asarray(prompt_where)
    return [tuple(t[w].tolist()) for t, w in zip(tokens, where, strict=True)
            for _ in range(group_size)]  # fmt: skip


@program(static_argnums=(0, 4, 5, 6))
def _start(graphdef, params, prompt_tokens, prompt_where, cache_length, group_size, record):
    return prefill(graphdef, params, prompt_tokens, prompt_where, cache_length, group_size,
                   record_routing=record)  # fmt: skip


@program(static_argnums=(0, 5, 6, 9), donate_argnums=(3,))
def _turn(graphdef, params, logits, cache, key, config, end_sequences, done, limit, record):
    return decode(graphdef, params, logits, cache, key, config, done=done, limit=limit,
                  end_sequences=end_sequences, record_routing=record)  # fmt: skip


@program(static_argnums=(0, 6), donate_argnums=(3,))
def _observe(graphdef, params, logits, cache, tokens, where, record):
    """The `[R, O]` observation block (each row's tokens first, then padding) written into the
    cache, and the next-token logits after each row's last observation token (unchanged for a
    row without one); with `record`, also the `[M, R, O, k]` experts of its tokens."""
    model = nnx.merge(graphdef, params)
    hidden, cache, *routing = model.extend(tokens, where, cache, return_routing=record)
    logits = jnp.where(where.any(-1)[:, None], last_logits(model, hidden, where), logits)
    return logits, cache, *routing


def _step(environment: Environment, ids: tuple[int, ...], tokenizer, truncated: bool):
    """`environment.step` of a turn, its text decoded first (in the step's own thread, so
    that a decoding error fails only its row)."""
    text = None if tokenizer is None else tokenizer.decode(ids)
    return environment.step(Turn(ids, text, truncated))


class _Run:
    """The host side of the episodes: their environments, and `[R, T]` NumPy buffers of the
    episodes filled turn by turn (recording, `[R, P + T, M, k]` routing too)."""

    def __init__(self, environments: list, config: EpisodeConfig, vocab_size: int, tokenizer):
        self.environments, self.config = environments, config
        self.vocab_size, self.tokenizer = vocab_size, tokenizer
        rows = len(environments)
        size, turns = (rows, config.max_tokens), (rows, config.max_turns)
        self.tokens = np.full(size, config.sampling.pad_token, np.int32)
        self.roles = np.full(size, Role.PADDING, np.int8)
        self.logps = np.zeros(size, np.float32)
        self.turn_ids = np.full(size, -1, np.int32)
        self.starts, self.ends = np.zeros(turns, np.int32), np.zeros(turns, np.int32)
        self.turn_rewards = np.zeros(turns, np.float32)
        self.num_turns, self.offset = np.zeros(rows, np.int32), np.zeros(rows, np.int64)
        self.active = np.ones(rows, np.bool_)
        self.truncated, self.failed = np.zeros(rows, np.bool_), np.zeros(rows, np.bool_)
        self.routing, self.prompt_len = None, 0  # set by `record_prompts`

    def reset(self, prompts: list) -> None:
        """Reset each row's environment with its prompt ids (in threads)."""
        resets = [
            functools.partial(e.reset, p) for e, p in zip(self.environments, prompts, strict=True)
        ]
        for r, outcome in enumerate(call_all(resets, self.config.step_timeout)):
            if outcome.error is not None:
                self.fail(r, f"reset {outcome.error}")

    def record_prompts(self, routing: np.ndarray) -> None:
        """Start recording routing with the prompts' `[M, R, P, k]` (the prefill's)."""
        layers, rows, self.prompt_len, k = routing.shape
        width = self.prompt_len + self.config.max_tokens
        self.routing = np.zeros((rows, width, layers, k), np.int32)
        self.routing[:, : self.prompt_len] = routing.transpose(1, 2, 0, 3)

    def record_observations(self, routing: np.ndarray, where: np.ndarray) -> None:
        """The `[M, R, O, k]` routing of an observation block (`where` `[R, O]`, each row's
        tokens first), at the positions `observe` just gave each row's observation."""
        for r in np.flatnonzero(where.any(-1)).tolist():
            size = int(where[r].sum())
            stop = self.prompt_len + int(self.offset[r])
            self.routing[r, stop - size : stop] = routing[:, r, :size].transpose(1, 0, 2)

    def limits(self, slots_left: int) -> np.ndarray:
        """The `[R]` int32 most tokens each row's next turn may draw, its budget or the
        cache's free slots (0 on ended rows); a row with none left ends `truncated`."""
        budget = np.minimum(self.config.max_tokens - self.offset, slots_left)
        limit = np.where(self.active, budget, 0)
        for r in np.flatnonzero(self.active & (limit < 1)).tolist():
            self.end(r, truncated=True)
        return limit.astype(np.int32)

    def step(self, turn: int, tokens, where, logps, ended, routing) -> dict[int, np.ndarray]:
        """Record the `[R, N]` turn the model drew on each active row (and its `[M, R, N, k]`
        routing, when recording), step the rows' environments with it (in threads) and
        record their answers; the observations of the rows that go on, by row."""
        stepping = np.flatnonzero(self.active).tolist()
        calls: list = [None] * len(self.environments)
        for r in stepping:
            ids = self.add_turn(r, turn, tokens[r][where[r]], logps[r][where[r]])
            if self.routing is not None:
                stop = self.prompt_len + int(self.offset[r])
                chosen = routing[:, r][:, where[r]].transpose(1, 0, 2)
                self.routing[r, stop - len(ids) : stop] = chosen
            calls[r] = functools.partial(
                _step, self.environments[r], ids, self.tokenizer, not ended[r]
            )
        outcomes = call_all(calls, self.config.step_timeout)
        observations = {r: self.take_step(r, turn, outcomes[r]) for r in stepping}
        return {r: ids for r, ids in observations.items() if ids is not None}

    def observe(self, turn: int, observations: dict, *, room: int):
        """Record the observations, and return the `[R, O]` block of their tokens and mask to
        write into the cache (None when there is nothing to write). When the cache's `room`
        free slots cannot hold the block and a next turn's token, their rows end `truncated`
        instead."""
        width = self.config.max_observation_tokens
        observed = any(ids.size for ids in observations.values())
        if observations and room < observed * width + 1:
            for r in observations:
                self.end(r, truncated=True)
            return None
        for r, ids in observations.items():
            self.add_observation(r, turn, ids)
        if not observed:
            return None
        block = np.full((len(self.environments), width), self.config.sampling.pad_token, np.int32)
        block_where = np.zeros(block.shape, np.bool_)
        for r, ids in observations.items():
            block[r, : ids.size], block_where[r, : ids.size] = ids, True
        return block, block_where

    def episode(self) -> Episode:
        roles = self.roles
        rewards = self.turn_rewards.sum(-1, dtype=np.float32)
        arrays = dict(
            tokens=self.tokens, roles=roles, where=roles == Role.MODEL,
            context_where=roles != Role.PADDING, logps=self.logps, turn_ids=self.turn_ids,
            turn_starts=self.starts, turn_ends=self.ends, turn_rewards=self.turn_rewards,
            rewards=rewards, num_turns=self.num_turns,
            lengths=(roles != Role.PADDING).sum(-1, dtype=np.int32),
            truncated=self.truncated, failed=self.failed,
            temperature=np.float32(self.config.sampling.temperature or 1.0),
        )  # fmt: skip
        if self.routing is not None:
            arrays["routing"] = self.routing
        stamp = dict.fromkeys(_STAMP)  # run_episodes stamps it when given a version
        return Episode(**{name: jnp.asarray(x) for name, x in arrays.items()}, **stamp)

    def end(self, r: int, *, truncated: bool = False) -> None:
        self.active[r] = False
        self.truncated[r] |= truncated

    def fail(self, r: int, reason: str) -> None:
        self.end(r)
        self.failed[r] = True
        self.turn_rewards[r] = 0.0
        _logger.warning("episode row %d failed: its environment %s", r, reason)

    def add_turn(self, r: int, turn: int, ids: np.ndarray, logps: np.ndarray) -> tuple[int, ...]:
        start, stop = self.offset[r], self.offset[r] + ids.size
        self.tokens[r, start:stop], self.logps[r, start:stop] = ids, logps
        self.roles[r, start:stop], self.turn_ids[r, start:stop] = Role.MODEL, turn
        self.starts[r, turn], self.ends[r, turn] = start, stop
        self.num_turns[r], self.offset[r] = turn + 1, stop
        return tuple(ids.tolist())

    def add_observation(self, r: int, turn: int, ids: np.ndarray) -> None:
        start, stop = self.offset[r], self.offset[r] + ids.size
        self.tokens[r, start:stop], self.roles[r, start:stop] = ids, Role.OBSERVATION
        self.turn_ids[r, start:stop], self.offset[r] = turn, stop

    def take_step(self, r: int, turn: int, outcome) -> np.ndarray | None:
        """Record row `r`'s answer to its turn; the observation to append, or None when the
        episode ends here."""
        if outcome.error is not None:
            self.fail(r, f"step {outcome.error}")
            return None
        try:
            observation, reward, done = self._checked_step(outcome.value)
        except (TypeError, ValueError) as error:
            self.fail(r, f"step returned an invalid Step: {error}")
            return None
        self.turn_rewards[r, turn] = reward
        if done:
            self.end(r)
            return None
        fits = observation.size <= self.config.max_observation_tokens
        if (
            turn + 1 == self.config.max_turns
            or not fits
            or (self.offset[r] + observation.size >= self.config.max_tokens)
        ):
            self.end(r, truncated=True)
            return None
        return observation

    def _checked_step(self, step: object) -> tuple[np.ndarray, float, bool]:
        if not isinstance(step, tuple) or len(step) != 3:
            raise TypeError(f"expected a Step(observation, reward, done), got {step!r:.200}")
        observation, reward, done = step
        if not isinstance(done, (bool, np.bool_)):
            raise TypeError(f"done must be a bool, got {done!r}")
        if not v.is_real_number(reward) or not math.isfinite(reward):
            raise ValueError(f"reward must be a finite real number, got {reward!r}")
        if done:
            return np.zeros(0, np.int32), float(reward), True
        if isinstance(observation, str):
            if self.tokenizer is None:
                raise TypeError("the observation is text, but run_episodes has no tokenizer")
            observation = self.tokenizer.encode(observation)
        ids = np.asarray(observation)
        if ids.size == 0:
            ids = ids.reshape(0).astype(np.int32)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"the observation must be 1-D token ids, got {observation!r:.200}")
        if ids.size and not (ids.min() >= 0 and ids.max() < self.vocab_size):
            raise ValueError(
                f"observation ids must lie in [0, {self.vocab_size}), got {ids.min()} to "
                f"{ids.max()}"
            )
        return ids.astype(np.int32), float(reward), False
