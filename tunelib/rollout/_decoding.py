"""The rollout core: KV-cache prefill and the decode loop, shared by `sample` and `run_episodes`.

The internal API of `tunelib.rollout` (none of it is public; `sample` and `run_episodes` are
built from it, each in its own jitted functions):

- `checked_prompts(graphdef, params, prompt_tokens, prompt_where, config, group_size)`: the
  prompts as arrays and the model's config, after every check that needs no cache length.
- `checked_images(graphdef, params, images)`: the pixel arrays of the prompts' images, for a
  `VisionLanguageModel` (None without images).
- `shape_module(graphdef, params)`: the module merged from the parameters' shapes alone, for
  its config and its layouts.
- `check_record_routing(record_routing, model_config)`: `record_routing` is a bool, and True
  only for a model with mixture-of-experts layers.
- `pure_params(params)`, `as_key(key)`: the parameters as plain arrays and the key as a
  new-style PRNG key, as the functions below take them; `decoding_params(graphdef, params,
  layout)`: the plain parameters, with `layout="per_layer"` in the layout a decode loop reads
  without copying, as `sample` and `run_episodes` hand them to their programs;
  `products_context(products)`: the context their programs run in for `products`.
- `prefill(graphdef, params, prompt_tokens, prompt_where, cache_length, group_size, *,
  windowed, record_routing, images)`: the next-token logits after each prompt and the KV
  cache holding the prompts (windowed: sliding-window layers in rings of their window; the
  images encoded into it once), forked `group_size` ways (and, recording, the prompts' MoE
  routing).
- `last_logits(model, hidden, where)`: the next-token logits after each row's last real
  token of a block that `Decoder.extend` ran (prefill and an episode's observations).
- `decode(graphdef, params, logits, cache, key, config, *, done, limit, end_sequences,
  record_routing)`: the decode loop, a `lax.while_loop` of one token per row a step from
  next-token logits and a cache; it returns a `Decoded`, the drawn tokens and where the cache
  and logits stand after them, so that a caller can continue the same cache.

`config` is a `SamplingConfig` (`tunelib.rollout.sample` checks that it is one). Nothing here
is jitted: the callers jit whole programs of these steps.
"""

import contextlib
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import PyTree

from tunelib import _validation as v
from tunelib._products import unblocked_products
from tunelib.models import KVCache
from tunelib.rollout._compiled import holds_peft_values
from tunelib.rollout._processors import check_sampling_args, forbid_tokens, process_logits


def checked_prompts(
    graphdef: nnx.GraphDef,
    params: PyTree,
    prompt_tokens: ArrayLike,
    prompt_where: ArrayLike,
    config,
    group_size: int,
) -> tuple[jax.Array, jax.Array, object]:
    """The prompts as arrays and the model's config, after every check that needs no cache
    length: `group_size`, the sampling `config` against the vocabulary, and (when they are
    concrete) empty prompts and prompt ids outside the vocabulary."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}.")
    prompt_tokens = v.int_array(prompt_tokens, "prompt_tokens")
    if prompt_tokens.ndim != 2:
        raise ValueError(f"prompt_tokens must have shape [B, P], got {prompt_tokens.shape}.")
    prompt_where = v.mask_array(prompt_where, prompt_tokens.shape, "prompt_where")
    model_config = shape_module(graphdef, params).config
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


def checked_images(
    graphdef: nnx.GraphDef, params: PyTree, images, prompt_tokens=None, prompt_where=None
) -> dict | None:
    """The image arrays of `images` that the model reads (`VisionLanguageModel.image_inputs`:
    Gemma 4's `pixel_values` and `image_position_ids` as `tunelib.data.gemma4_image_inputs`
    returns them, Qwen3.5's `pixel_values` and `image_grid_thw` as
    `tunelib.data.qwen_vl_image_inputs` does; other keys are left), or None; a `ValueError`
    for images given to a model that reads none, and, when `images` holds
    `num_soft_tokens_per_image` and the prompts are known (not traced), for prompts whose
    image tokens are not as many as the images' soft tokens (a marker not expanded, an
    image too many or too few): the model would fill them with padding or drop features."""
    if images is None:
        return None
    model = shape_module(graphdef, params)
    names = getattr(model, "image_inputs", None)
    if names is None:
        raise ValueError(
            "images are given, but the model is not a tunelib.models.VisionLanguageModel."
        )
    missing = set(names) - set(images)
    if missing:
        raise ValueError(
            f"images must hold {' and '.join(names)} (as the model's image preprocessing in "
            f"tunelib.data returns them); {sorted(missing)} missing."
        )
    counts = images.get("num_soft_tokens_per_image")
    known = not any(isinstance(x, jax.core.Tracer) for x in (prompt_tokens, prompt_where, counts))
    if counts is not None and prompt_tokens is not None and known:
        image = np.asarray(prompt_tokens) == model.image_token_id
        if prompt_where is not None:
            image &= np.asarray(prompt_where, bool)
        soft = [int(n) for n in np.asarray(counts).reshape(-1)]
        if int(image.sum()) != sum(soft):
            raise ValueError(
                f"the prompts hold {int(image.sum())} image tokens (id "
                f"{model.image_token_id}) but the images {sum(soft)} soft tokens ({soft} per "
                "image): expand each image's marker with tunelib.data.expand_image_tokens."
            )
    return {
        name: v.float_array(images[name], name) if name == "pixel_values" else
        v.int_array(images[name], name)
        for name in names
    }  # fmt: skip


def shape_module(graphdef: nnx.GraphDef, params: PyTree) -> nnx.Module:
    """The module of `graphdef` merged from the shapes and dtypes of `params` alone, to read
    its config or methods that need no values: a module made of the arrays themselves would
    hold them in reference cycles until Python's next garbage collection."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params)
    return nnx.merge(graphdef, shapes)


def check_record_routing(record_routing: bool, model_config) -> None:
    """`record_routing` (of `sample` or `run_episodes`) is a bool, and True only for a model
    with mixture-of-experts layers (`model_config`, a `DecoderConfig`)."""
    if not isinstance(record_routing, bool):
        raise TypeError(f"record_routing must be a bool, got {record_routing!r}.")
    if record_routing and not any(model_config.moe_layers):
        raise ValueError(
            "record_routing=True, but this model has no mixture-of-experts layers "
            f"(num_experts={model_config.num_experts}): there is no routing to record."
        )


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


def pure_params(params: PyTree) -> PyTree:
    """Plain arrays: loop bodies merge them into a module again."""
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


# How a program reads a stacked model's layers (`sample`'s `layout`).
Layout = Literal["stacked", "per_layer"]
LAYOUTS = ("stacked", "per_layer")


# How a rollout's float32 products on CPU add up (`sample`'s `products`).
Products = Literal["blocked", "plain"]
PRODUCTS = ("blocked", "plain")


def products_context(products: Products) -> contextlib.AbstractContextManager:
    """The context in which `sample` and `run_episodes` call their programs: with "plain",
    `Dense` traces float32 products on CPU as one dot each instead of its blocked sums
    (`tunelib._products.unblocked_products`; the programs are keyed by it)."""
    return unblocked_products() if products == "plain" else contextlib.nullcontext()


def decoding_params(graphdef: nnx.GraphDef, params: PyTree, layout: Layout) -> PyTree:
    """The plain `params` (`pure_params`), with `layout="per_layer"` in the layout a decode
    loop reads without copying (`Decoder.decoding_layout`: stacked layers' dense weights one
    array per layer), found from their `shape_module`. Parameters holding `tunelib.peft`
    values are returned as they are: `peft.lora` runs them."""
    params = pure_params(params)
    if layout == "stacked" or holds_peft_values(params):
        return params
    return shape_module(graphdef, params).decoding_layout(params)


def as_key(key: jax.Array) -> jax.Array:
    """A new-style PRNG key (legacy uint32 keys are wrapped)."""
    if isinstance(key, jax.Array) and not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(key)
    return key


def prefill(
    graphdef: nnx.GraphDef,
    params: PyTree,
    prompt_tokens: jax.Array,
    prompt_where: jax.Array,
    cache_length: int,
    group_size: int,
    *,
    windowed: bool = False,
    record_routing: bool = False,
    images: dict[str, jax.Array] | None = None,
) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
    """Next-token logits `[B * G, V]` after each prompt's last real token, and the KV cache of
    `cache_length` slots holding the prompts (`windowed`: `Decoder.init_cache`'s), each row
    repeated `group_size` times (a fork of one prefill); with `record_routing`, also the
    `[M, B * G, P, k]` experts each prompt token was routed to (`Decoder.extend`'s
    `return_routing`), repeated as the cache is. `images` (the arrays a
    `VisionLanguageModel`'s `image_inputs` names) are encoded once, in the prefill."""
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(prompt_tokens.shape[0], cache_length, windowed=windowed)
    hidden, cache, *routing = model.extend(
        prompt_tokens, prompt_where, cache, return_routing=record_routing, **(images or {})
    )
    logits = last_logits(model, hidden, prompt_where)
    if group_size > 1:  # fork the prefilled cache: row b * G + g continues prompt b
        cache = cache.repeat_rows(group_size)
        logits = jnp.repeat(logits, group_size, axis=0)
        routing = [jnp.repeat(r, group_size, axis=1) for r in routing]
    return logits, cache, *routing


def last_logits(model: nnx.Module, hidden: jax.Array, where: jax.Array) -> jax.Array:
    """The `[R, V]` next-token logits of a `Decoder.extend` block, from its `[R, T, H]` hidden
    states at each row's last real position (`where` `[R, T]`; a row with no real token
    gives the logits of its last position, which callers discard)."""
    last = where.shape[1] - 1 - jnp.argmax(where[:, ::-1], axis=1)
    return model.unembed(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])


class Decoded(NamedTuple):
    """What `decode` returns: the `[R, N]` tokens, mask and log-probs it drew, `[R]` flags
    (`done`: the row stopped drawing, for any reason; `ended`: by a stop token or an end
    sequence), the next-token logits after each row's last token and the cache; recording,
    the `[M, R, N, k]` experts each drawn token was routed to, else None."""

    tokens: jax.Array
    where: jax.Array
    logps: jax.Array
    done: jax.Array
    ended: jax.Array
    logits: jax.Array
    cache: KVCache
    routing: jax.Array | None = None


def decode(
    graphdef: nnx.GraphDef,
    params: PyTree,
    logits: jax.Array,
    cache: KVCache,
    key: jax.Array,
    config,
    *,
    done: jax.Array | None = None,
    limit: jax.Array | None = None,
    end_sequences: tuple[tuple[int, ...], ...] = (),
    record_routing: bool = False,
) -> Decoded:
    """The decode loop: up to `config.max_new_tokens` steps of one token per row, from `[R, V]`
    next-token logits and a cache, inside a `lax.while_loop` that ends once every row is done.

    A row that starts `done` (`[R]`; None: no row) draws nothing (its slots are padding). A
    row is done after a stop token, after a token that completes one of `end_sequences`
    (static tuples of token ids, drawn in this call), or, with `limit` (`[R]` ints), after
    `limit` tokens. Step `t` draws with `fold_in(key, t)`. Every step writes one cache slot
    for every row. With `record_routing`, step `t` also writes the experts its token went to
    in each MoE layer into column `t` of `Decoded.routing`.
    """
    rows, new = logits.shape[0], config.max_new_tokens
    stop = jnp.asarray(
        config.stop_tokens + tuple(s[0] for s in end_sequences if len(s) == 1) or (-1,),
        jnp.int32,
    )
    longer = tuple(s for s in end_sequences if len(s) > 1)
    width = max((len(s) for s in longer), default=1) - 1

    def running(state):
        step, *_, done, _, _, _, _, _ = state
        return (step < new) & ~jnp.all(done)

    def step_fn(state):
        step, tokens, where, logps, done, ended, tail, logits, cache, routing = state
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
        hidden, cache, *routed = step_model.extend(
            token[:, None], live[:, None], cache, return_routing=record_routing
        )
        if record_routing:
            routing = jax.lax.dynamic_update_slice_in_dim(routing, routed[0], step, 2)
        # A row that drew nothing keeps the logits after its last real token.
        logits = jnp.where(live[:, None], step_model.unembed(hidden[:, 0]), logits)
        return step + 1, tokens, where, logps, done, ended, tail, logits, cache, routing

    state = (
        jnp.zeros((), jnp.int32),
        jnp.full((rows, new), config.pad_token, jnp.int32),
        jnp.zeros((rows, new), jnp.bool_),
        jnp.zeros((rows, new), jnp.float32),
        jnp.zeros((rows,), jnp.bool_) if done is None else done,
        jnp.zeros((rows,), jnp.bool_),
        jnp.full((rows, width), -1, jnp.int32),
        logits,
        cache,
        _routing_buffer(graphdef, params, rows, new) if record_routing else None,
    )
    _, tokens, where, logps, done, ended, _, logits, cache, routing = jax.lax.while_loop(
        running, step_fn, state
    )
    return Decoded(tokens, where, logps, done, ended, logits, cache, routing)


def _routing_buffer(graphdef: nnx.GraphDef, params: PyTree, rows: int, new: int) -> jax.Array:
    """Zeros `[M, rows, new, k]` int32 for the experts of `new` tokens in each of the model's
    M mixture-of-experts layers (a valid expert id in slots no token reaches)."""
    c = shape_module(graphdef, params).config
    return jnp.zeros((sum(c.moe_layers), rows, new, c.num_experts_per_tok), jnp.int32)


def _draw(logits: jax.Array, key: jax.Array, config) -> tuple[jax.Array, jax.Array]:
    """One token per row from the processed distribution of `[R, V]` logits, and the `[R, V]`
    log-probs it is recorded under (`SamplingConfig.logps_of`)."""
    logits = logits.astype(jnp.float32)
    allowed = forbid_tokens(logits, config.forbidden_tokens)
    if config.temperature == 0:
        return jnp.argmax(allowed, axis=-1), jax.nn.log_softmax(logits)
    processed = process_logits(
        _tempered(allowed, config.temperature),  # then divided by 1: exactly the same
        temperature=1.0,
        top_k=config.top_k,
        top_p=config.top_p,
        min_p=config.min_p,
    )
    token = jax.random.categorical(key, processed, axis=-1)
    if config.logps_of == "processed":
        return token, jax.nn.log_softmax(processed)
    return token, jax.nn.log_softmax(_tempered(logits, config.temperature))


def _tempered(logits: jax.Array, temperature: float) -> jax.Array:
    """`logits / temperature`, except in a row where that overflows (a temperature so small
    that the largest logit over it is inf: then every positive logit is, the tokens tie and
    the log-softmax is NaN): there the row's largest finite logit is subtracted first, which
    leaves the distribution as it is (softmax is shift-invariant) and sends every token but
    the largest to -inf. The rows that do not overflow are bit for bit the plain quotient."""
    scaled = logits / temperature
    top = jnp.max(jnp.where(jnp.isfinite(logits), logits, -jnp.inf), axis=-1, keepdims=True)
    shifted = (logits - jnp.where(jnp.isfinite(top), top, 0.0)) / temperature
    overflowed = jnp.isposinf(jnp.max(scaled, axis=-1, keepdims=True))
    return jnp.where(overflowed, shifted, scaled)
