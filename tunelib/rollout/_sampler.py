"""The KV-cache sampler: jit-compiled prefill and a `lax.while_loop` decode."""

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int, PyTree

from tunelib import _validation as v
from tunelib.models import KVCache
from tunelib.rollout._processors import (
    check_sampling_args,
    check_sampling_values,
    forbid_tokens,
    process_logits,
)

LogpsOf = Literal["tempered", "processed"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How `sample` draws completions. Static: each distinct config compiles once.

    Every field is checked when the config is made, with a `TypeError` or `ValueError` that
    names it; what depends on the model's vocabulary (token ids below its size, not every
    token forbidden) is checked by `sample`, before anything compiles. Numbers are stored as
    Python ints and floats, token ids as tuples of ints.

    Attributes:
      max_new_tokens: the most tokens generated per completion, stop token included; an int
        >= 1.
      temperature: $\\tau \\ge 0$, finite; the next token is drawn from
        `softmax(logits / τ)` after the filters below. 0 is exact greedy decoding (argmax over
        the allowed tokens).
      top_k: keep the k most likely tokens, an int >= 1 (None: all).
      top_p: nucleus sampling, keep the smallest most-likely set with probability >= p,
        p in (0, 1] (None: all).
      min_p: keep the tokens with probability >= min_p times the largest, min_p in [0, 1]
        (None: all).
      forbidden_tokens: token ids (ints >= 0) never sampled.
      stop_tokens: token ids (ints >= 0) that end a completion; the stop token itself is part
        of the completion (inside `Rollout.where`), nothing after it is.
      pad_token: the id (an int >= 0) written after a completion ends (outside
        `Rollout.where`).
      cache_length: KV-cache slots, at least `max_new_tokens + 1` (a prompt has a token at
        least); None means prompt length + `max_new_tokens`, the least that fits. A larger
        cache lets one compiled sampler serve longer prompts.
      logps_of: which distribution `Rollout.logps` are taken from: "tempered" (default),
        the full vocabulary at the sampling temperature, `log_softmax(logits / τ)` before any
        filter: what a trainer recomputes from its own logits, so the ratio of the two is
        the sampler/trainer mismatch; or "processed", the distribution actually sampled
        from (filters applied, excluded tokens at probability 0). At temperature 0 both are
        the untempered `log_softmax(logits)`: finite, and what a trainer at temperature 1
        recomputes.
    """

    max_new_tokens: int
    temperature: float | int = 1.0
    top_k: int | None = None
    top_p: float | int | None = None
    min_p: float | int | None = None
    forbidden_tokens: tuple[int, ...] = ()
    stop_tokens: tuple[int, ...] = ()
    pad_token: int = 0
    cache_length: int | None = None
    logps_of: LogpsOf = "tempered"

    def __post_init__(self) -> None:
        v.static_int(self.max_new_tokens, "max_new_tokens")
        v.number_in(self.max_new_tokens, "max_new_tokens", low=1)
        check_sampling_values(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p
        )
        tokens = {
            name: v.token_id_tuple(getattr(self, name), name)
            for name in ("forbidden_tokens", "stop_tokens")
        }
        v.static_int(self.pad_token, "pad_token")
        v.number_in(self.pad_token, "pad_token", low=0, hint="token ids are >= 0")
        if self.cache_length is not None:
            v.static_int(self.cache_length, "cache_length")
            v.number_in(
                self.cache_length,
                "cache_length",
                low=self.max_new_tokens + 1,
                hint=f"max_new_tokens={self.max_new_tokens} slots and one for a prompt token",
            )
        v.one_of(self.logps_of, "logps_of", ("tempered", "processed"))
        normalized = {
            **tokens,
            "max_new_tokens": int(self.max_new_tokens),
            "temperature": float(self.temperature),
            "top_k": None if self.top_k is None else int(self.top_k),
            "top_p": None if self.top_p is None else float(self.top_p),
            "min_p": None if self.min_p is None else float(self.min_p),
            "pad_token": int(self.pad_token),
            "cache_length": None if self.cache_length is None else int(self.cache_length),
        }
        for name, value in normalized.items():
            object.__setattr__(self, name, value)


class Rollout(NamedTuple):
    """Completions from `sample`, one row per completion: a pytree of arrays, so it passes
    through `jax.jit` (every field but the scalar `temperature` has a row per completion).

    Attributes:
      tokens: `[B, N]` completion token ids, `pad_token` after each completion ends.
      where: `[B, N]` True on the completion's tokens, up to and including its first stop
        token; False after it.
      logps: `[B, N]` float32 behaviour log-probs of the sampled tokens (see
        `SamplingConfig.logps_of`), 0 outside `where`.
      lengths: `[B]` tokens per completion, `where.sum(-1)`.
      truncated: `[B]` True where the completion reached `max_new_tokens` without a stop
        token.
      temperature: float32 scalar, the temperature $\\tau$ of the distribution `logps` come
        from, so that a trainer recomputes them with `temperature=rollout.temperature`
        (`tunelib.logprobs.token_logps`) without carrying the `SamplingConfig` around: the
        config's temperature, or 1.0 for greedy decoding (temperature 0), whose log-probs are
        those of the untempered distribution.
    """

    tokens: Int[Array, "B N"]
    where: Bool[Array, "B N"]
    logps: Float[Array, "B N"]
    lengths: Int[Array, " B"]
    truncated: Bool[Array, " B"]
    temperature: Float[Array, ""]


def sample(
    graphdef: nnx.GraphDef,
    params: PyTree,
    prompt_tokens: Int[ArrayLike, "B P"],
    prompt_where: Bool[ArrayLike, "B P"],
    key: jax.Array,
    config: SamplingConfig,
    *,
    group_size: int = 1,
) -> Rollout:
    r"""Sample completions of prompts with a KV cache: prefill once, then decode a token a step.

    The prompts are prefilled in one forward pass (`Decoder.extend`); then each step draws
    a token per row from the processed distribution of the last logits,

    $$
    y_t \sim \mathrm{softmax}\big(\mathrm{filters}(\ell_t / \tau)\big), \qquad
    \text{or } y_t = \arg\max_v \ell_{t,v} \text{ when } \tau = 0,
    $$

    records its log-prob, and feeds it back through the cache, inside one `lax.while_loop`
    that ends as soon as every row has produced a stop token (or after `max_new_tokens`).
    The filters are `tunelib.rollout.process_logits` (forbidden tokens, then top-k, top-p,
    min-p on the tempered logits). Step $t$ draws with `jax.random.fold_in(key, t)`, each row
    independently: the same key reproduces a call exactly, different keys give different
    samples.

    With `group_size` G, each prompt is prefilled once and its cache copied G ways, so the
    G completions of a prompt share one prefill and differ only by their draws; row
    `b * G + g` of the result is completion g of prompt b (the flat layout that
    `tunelib.advantages.group_advantages(rewards, group_size=G)` takes).

    Prompts may be padded on either side: positions and attention follow
    `prompt_where`, and decoding continues from each row's last real token. Every prompt
    needs at least one real token.

    Args:
      graphdef: the `nnx.GraphDef` of a `tunelib.models.Decoder` (static).
      params: its parameters (an `nnx.State` or the pure dict of one), possibly sharded.
      prompt_tokens: `[B, P]` prompt token ids.
      prompt_where: `[B, P]` True on real prompt tokens.
      key: a PRNG key (new-style `jax.random.key` or legacy uint32).
      config: a `SamplingConfig` (static).
      group_size: completions per prompt, G >= 1.

    Returns:
      A `Rollout` of `B * G` completions of `config.max_new_tokens` slots.

    Raises:
      ValueError: before compiling, for a config the vocabulary cannot satisfy (stop,
        forbidden or pad ids out of range, every token forbidden; the rest of the config is
        checked when it is made), a prompt longer than the cache, an empty prompt or a prompt
        token id outside the vocabulary (both checked when the prompts are concrete, not
        traced), or a bad `group_size`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from tunelib.models import Decoder, DecoderConfig
      >>> from tunelib.rollout import SamplingConfig, sample
      >>> cfg = DecoderConfig(vocab_size=16, hidden_size=32, intermediate_size=64,
      ...                     num_hidden_layers=1, num_attention_heads=2, head_dim=16)
      >>> graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
      >>> prompts = jnp.array([[0, 3, 4], [5, 6, 7]])
      >>> where = jnp.array([[False, True, True], [True, True, True]])  # left-padded
      >>> config = SamplingConfig(max_new_tokens=6, temperature=0.8, top_p=0.9,
      ...                         stop_tokens=(2,))
      >>> out = sample(graphdef, params, prompts, where, jax.random.key(0), config,
      ...              group_size=3)
      >>> print(out.tokens.shape, out.lengths.shape)
      (6, 6) (6,)
      >>> bool((out.lengths == out.where.sum(-1)).all())
      True

    References:
      Holtzman et al., "The Curious Case of Neural Text Degeneration" (top-p), 2020,
      https://arxiv.org/abs/1904.09751.
      Pope et al., "Efficiently Scaling Transformer Inference" (KV caching), 2022,
      https://arxiv.org/abs/2211.05102.
    """
    prompt_tokens, prompt_where, _ = _checked_inputs(
        graphdef, params, prompt_tokens, prompt_where, config, group_size
    )
    prompt_len = prompt_tokens.shape[1]
    needed = prompt_len + config.max_new_tokens
    if config.cache_length is not None and config.cache_length < needed:
        raise ValueError(
            f"prompts of {prompt_len} positions plus max_new_tokens={config.max_new_tokens} "
            f"need {needed} cache slots, but cache_length is {config.cache_length}."
        )
    return _sample(graphdef, params, prompt_tokens, prompt_where, key, config, group_size)


def _checked_inputs(
    graphdef: nnx.GraphDef,
    params: PyTree,
    prompt_tokens: ArrayLike,
    prompt_where: ArrayLike,
    config: SamplingConfig,
    group_size: int,
) -> tuple[jax.Array, jax.Array, object]:
    """The prompts as arrays and the model's config, after every check that needs no cache
    length: the config against the vocabulary, `group_size`, and (when they are concrete)
    empty prompts and prompt ids outside the vocabulary."""
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}.")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}.")
    prompt_tokens = v.int_array(prompt_tokens, "prompt_tokens")
    if prompt_tokens.ndim != 2:
        raise ValueError(f"prompt_tokens must have shape [B, P], got {prompt_tokens.shape}.")
    prompt_where = v.mask_array(prompt_where, prompt_tokens.shape, "prompt_where")
    # The config of a model merged from shapes alone: a module made of the arrays themselves
    # would hold them in reference cycles until Python's next garbage collection.
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params)
    model_config = nnx.merge(graphdef, shapes).config
    check_sampling_args(
        vocab_size=model_config.vocab_size,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        min_p=config.min_p,
        forbidden_tokens=config.forbidden_tokens,
        stop_tokens=config.stop_tokens,
    )
    if not 0 <= config.pad_token < model_config.vocab_size:
        raise ValueError(
            f"pad_token must lie in [0, {model_config.vocab_size}), got {config.pad_token}."
        )
    if not isinstance(prompt_where, jax.core.Tracer):
        for first, real in _rows_held_here(prompt_where):
            empty = first + np.flatnonzero(~real.any(axis=1))
            if empty.size:
                raise ValueError(
                    f"prompt_where has no real token in rows {empty[:10].tolist()}: every "
                    "prompt needs at least one token to condition on (start empty prompts "
                    "with a BOS)."
                )
        if not isinstance(prompt_tokens, jax.core.Tracer):
            pairs = zip(_rows_held_here(prompt_tokens), _rows_held_here(prompt_where), strict=True)
            ids = np.concatenate([np.zeros(0, np.int64)] + [t[w] for (_, t), (_, w) in pairs])
            if ids.size and not (ids.min() >= 0 and ids.max() < model_config.vocab_size):
                raise ValueError(
                    f"prompt_tokens must lie in [0, {model_config.vocab_size}) where "
                    f"prompt_where is True, got ids from {ids.min()} to {ids.max()}."
                )
    return prompt_tokens, prompt_where, model_config


def _rows_held_here(x: jax.Array) -> list[tuple[int, np.ndarray]]:
    """`(first row, whole rows)` blocks of `[B, P]` `x` that this process holds: all of it,
    or, for an array spread over several processes (a multi-process run), its addressable
    shards that hold whole rows, so each process checks its own prompts."""
    if getattr(x, "is_fully_addressable", True):
        return [(0, np.asarray(x))]
    blocks = {}
    for shard in x.addressable_shards:
        rows, columns = shard.index
        if columns.indices(x.shape[1]) == (0, x.shape[1], 1):
            blocks[rows.indices(x.shape[0])[0]] = np.asarray(shard.data)
    return sorted(blocks.items(), key=lambda block: block[0])


@jax.jit(static_argnums=(0, 5, 6))
def _sample(graphdef, params, prompt_tokens, prompt_where, key, config, group_size):
    params = _pure(params)
    logits, cache = _prefill(
        graphdef,
        params,
        prompt_tokens,
        prompt_where,
        config.cache_length or prompt_tokens.shape[1] + config.max_new_tokens,
        group_size,
    )
    done = jnp.zeros((logits.shape[0],), jnp.bool_)
    out = _decode(graphdef, params, logits, cache, _as_key(key), config, done=done)
    temperature = jnp.asarray(config.temperature or 1.0, jnp.float32)
    lengths = out.where.sum(-1, dtype=jnp.int32)
    return Rollout(out.tokens, out.where, out.logps, lengths, ~out.done, temperature)


def _pure(params: PyTree) -> PyTree:
    """Plain arrays: loop bodies merge them into a module again."""
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def _as_key(key: jax.Array) -> jax.Array:
    """A new-style PRNG key (legacy uint32 keys are wrapped)."""
    if isinstance(key, jax.Array) and not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(key)
    return key


def _prefill(graphdef, params, prompt_tokens, prompt_where, cache_length, group_size):
    """Next-token logits `[B * G, V]` after each prompt's last real token, and the KV cache of
    `cache_length` slots holding the prompts, each row repeated `group_size` times (a fork of
    one prefill)."""
    model = nnx.merge(graphdef, params)
    batch, prompt_len = prompt_tokens.shape
    cache = model.init_cache(batch, cache_length)
    hidden, cache = model.extend(prompt_tokens, prompt_where, cache)
    last = prompt_len - 1 - jnp.argmax(prompt_where[:, ::-1], axis=1)
    logits = model.unembed(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])
    if group_size > 1:  # fork the prefilled cache: row b * G + g continues prompt b
        cache = cache.repeat_rows(group_size)
        logits = jnp.repeat(logits, group_size, axis=0)
    return logits, cache


def _draw(logits: jax.Array, key: jax.Array, config: SamplingConfig):
    """One token per row from the processed distribution of `[R, V]` logits, and the `[R, V]`
    log-probs it is recorded under (`SamplingConfig.logps_of`)."""
    logits = logits.astype(jnp.float32)
    allowed = forbid_tokens(logits, config.forbidden_tokens)
    if config.temperature == 0:
        return jnp.argmax(allowed, axis=-1), jax.nn.log_softmax(logits)
    processed = process_logits(
        allowed,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        min_p=config.min_p,
    )
    token = jax.random.categorical(key, processed, axis=-1)
    if config.logps_of == "processed":
        return token, jax.nn.log_softmax(processed)
    return token, jax.nn.log_softmax(logits / config.temperature)


class _Decoded(NamedTuple):
    """What `_decode` returns: the `[R, N]` tokens, mask and log-probs it drew, `[R]` flags
    (`done`: the row stopped drawing, for any reason; `ended`: by a stop token or an end
    sequence), the next-token logits after each row's last token and the cache."""

    tokens: jax.Array
    where: jax.Array
    logps: jax.Array
    done: jax.Array
    ended: jax.Array
    logits: jax.Array
    cache: KVCache


def _decode(
    graphdef, params, logits, cache, key, config, *, done, limit=None, end_sequences=()
) -> _Decoded:
    """The decode loop: up to `config.max_new_tokens` steps of one token per row, from `[R, V]`
    next-token logits and a cache, inside a `lax.while_loop` that ends once every row is done.

    A row that starts `done` (`[R]`) draws nothing (its slots are padding). A row is done after a
    stop token, after a token that completes one of `end_sequences` (static tuples of token
    ids, drawn in this call), or, with `limit` (`[R]` ints), after `limit` tokens. Step `t`
    draws with `fold_in(key, t)`. Every step writes one cache slot for every row.
    """
    rows, new = logits.shape[0], config.max_new_tokens
    stop = jnp.asarray(
        config.stop_tokens + tuple(s[0] for s in end_sequences if len(s) == 1) or (-1,),
        jnp.int32,
    )
    longer = tuple(s for s in end_sequences if len(s) > 1)
    width = max((len(s) for s in longer), default=1) - 1

    def running(state):
        step, *_, done, _, _, _, _ = state
        return (step < new) & ~jnp.all(done)

    def step_fn(state):
        step, tokens, where, logps, done, ended, tail, logits, cache = state
        token, all_logps = _draw(logits, jax.random.fold_in(key, step), config)
        live = ~done
        logp = jnp.take_along_axis(all_logps, token[:, None], axis=-1)[:, 0]
        token = jnp.where(live, token.astype(jnp.int32), config.pad_token)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], step, 1)
        where = jax.lax.dynamic_update_slice_in_dim(where, live[:, None], step, 1)
        logps = jax.lax.dynamic_update_slice_in_dim(
            logps, jnp.where(live, logp, 0.0)[:, None], step, 1
        )
        hit = jnp.isin(token, stop)
        if longer:  # the last tokens of the row, the newest at the end
            window = jnp.concatenate([tail, token[:, None]], axis=1)
            for sequence in longer:
                hit |= jnp.all(window[:, -len(sequence) :] == jnp.asarray(sequence), axis=1)
            tail = window[:, 1:]
        ended = ended | (live & hit)
        stopped = hit if limit is None else hit | (step + 1 >= limit)
        done = done | (live & stopped)
        # Merged inside the loop body: NNX modules do not cross into an inner trace.
        step_model = nnx.merge(graphdef, params)
        hidden, cache = step_model.extend(token[:, None], live[:, None], cache)
        # A row that drew nothing keeps the logits after its last real token.
        logits = jnp.where(live[:, None], step_model.unembed(hidden[:, 0]), logits)
        return step + 1, tokens, where, logps, done, ended, tail, logits, cache

    state = (
        jnp.zeros((), jnp.int32),
        jnp.full((rows, new), config.pad_token, jnp.int32),
        jnp.zeros((rows, new), jnp.bool_),
        jnp.zeros((rows, new), jnp.float32),
        done,
        jnp.zeros((rows,), jnp.bool_),
        jnp.full((rows, width), -1, jnp.int32),
        logits,
        cache,
    )
    _, tokens, where, logps, done, ended, _, logits, cache = jax.lax.while_loop(
        running, step_fn, state
    )
    return _Decoded(tokens, where, logps, done, ended, logits, cache)
