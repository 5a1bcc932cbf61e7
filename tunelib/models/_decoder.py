"""The reference decoder: Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mistral / Gemma 2, 3, 4 / gpt-oss
/ DeepSeek-V3 / Qwen3.5 in Flax NNX."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int, PyTree

from tunelib import _validation as v
from tunelib._deprecation import renamed_arguments
from tunelib._products import products_must_be_plain
from tunelib._typing import Mask
from tunelib.models._block import DecoderLayer
from tunelib.models._config import DecoderConfig
from tunelib.models._gated_delta_net import DeltaNetState
from tunelib.models._layers import Dense, Embedding, RMSNorm
from tunelib.models._mrope import mrope_angles, mrope_axes
from tunelib.models._per_layer import PerLayer
from tunelib.models._rope import rope_angles, rope_attention_factor, rope_frequencies
from tunelib.models._routing import checked_routing
from tunelib.models._scanned import run_stacks, stacked_layers, stacks_of
from tunelib.models._windowed import (
    CacheGroup,
    LayerCache,
    cache_groups,
    ring_key_slots,
    ring_mask,
)


class Decoder(nnx.Module):
    r"""A decoder-only transformer returning final-norm hidden states.

    With token embedding $E$, $L$ pre-norm layers and final RMSNorm $g_f$:

    $$
    \begin{aligned}
    h^{(0)}_t &= E_{x_t} \\
    u_t &= h^{(l)}_t + W_o \,\mathrm{Attn}\big(\mathrm{RMSNorm}(h^{(l)})\big)_t \\
    h^{(l+1)}_t &= u_t + W_d\big(\mathrm{silu}(W_g \bar u_t) \odot W_u \bar u_t\big),
    \quad \bar u_t = \mathrm{RMSNorm}(u_t) \\
    \mathrm{out}_t &= \mathrm{RMSNorm}_{g_f}(h^{(L)}_t), \qquad
    \mathrm{logits}_t = \mathrm{out}_t\, U
    \end{aligned}
    $$

    where attention head $n$ uses key/value head $\lfloor n / (N/K) \rfloor$ (grouped-query
    attention), queries and keys are (optionally RMS-normalised over the head, then) rotated
    by RoPE at their positions, and query $t$ of a row attends to key $s$ iff $s \le t$,
    `where[s]`, `segment_ids[s] == segment_ids[t]` (packed sequences) and, with
    `config.sliding_window` $W$, $t - s < W$. Tokens $x$ = `tokens`, $U$ = `unembedding()`
    ($E^\top$ when `config.tie_word_embeddings`). The architecture and the Hugging Face name
    of every weight are in `docs/models.md`.

    Calling the model returns `out`; `unembed(out)` gives the logits, kept separate so that a
    chunked log-prob computation can take `out` and `unembedding()` without ever forming
    `[B, T, V]` logits.

    Args:
      config: the `DecoderConfig`.
      rngs: the `nnx.Rngs` the weights are drawn from (stream "params", else "default").

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from tunelib.models import Decoder, DecoderConfig
      >>> cfg = DecoderConfig(
      ...     vocab_size=32, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
      ...     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      ...     tie_word_embeddings=True,
      ... )
      >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
      >>> tokens = jnp.array([[0, 0, 5, 7, 9]])
      >>> where = jnp.array([[False, False, True, True, True]])  # left-padded prompt
      >>> hidden = model(tokens, where=where)
      >>> logits = model.unembed(hidden)
      >>> print(hidden.shape, logits.shape, model.unembedding().shape)
      (1, 5, 64) (1, 5, 32) (64, 32)
      >>> print(jnp.sqrt(jnp.mean(hidden[0, 2:] ** 2, axis=-1)).round(3))  # unit RMS
      [1. 1. 1.]

      Two sequences packed into one row attend only within themselves, and their default
      positions restart at 0, so each gives the hidden states it gives alone:

      >>> @nnx.jit  # one compiled program for both forward passes
      ... def packed_and_alone(model, row, segment_ids):
      ...     return model(row, segment_ids=segment_ids), model(row[:, 3:])
      >>> row, segment_ids = jnp.array([[5, 7, 9, 4, 6]]), jnp.array([[1, 1, 1, 2, 2]])
      >>> packed, alone = packed_and_alone(model, row, segment_ids)
      >>> print(bool(jnp.allclose(packed[:, 3:], alone, atol=1e-6)))
      True

    References:
      Touvron et al., "LLaMA: Open and Efficient Foundation Language Models", 2023,
      https://arxiv.org/abs/2302.13971.
      Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models from
      Multi-Head Checkpoints", 2023, https://arxiv.org/abs/2305.13245.
      Zhang and Sennrich, "Root Mean Square Layer Normalization", 2019,
      https://arxiv.org/abs/1910.07467.
      Shazeer, "GLU Variants Improve Transformer", 2020, https://arxiv.org/abs/2002.05202.
      Yang et al., "Qwen3 Technical Report", 2025, https://arxiv.org/abs/2505.09388.
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}.")
        c = self.config = config
        self.embed_tokens = Embedding(c, rngs=rngs)
        if c.hidden_size_per_layer_input:
            p, names = c.hidden_size_per_layer_input, ("embed", "per_layer")
            width = c.num_hidden_layers * p
            self.embed_tokens_per_layer = Embedding(
                c, width=width, names=("vocab", "per_layer"), rngs=rngs
            )
            self.per_layer_model_projection = Dense(
                c.hidden_size, width, names, c, use_bias=False, rngs=rngs
            )
            self.per_layer_projection_norm = RMSNorm(p, "per_layer", c, rngs=rngs)
        if c.scan_layers:
            self.layers = stacked_layers(c, rngs)
        else:
            self.layers = nnx.List(
                [DecoderLayer(c, i, rngs=rngs) for i in range(c.num_hidden_layers)]
            )
        self.norm = RMSNorm(c.hidden_size, "embed", c, rngs=rngs)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else Dense(
                c.hidden_size, c.vocab_size, ("embed", "vocab"), c, use_bias=False, rngs=rngs
            )
        )

    @renamed_arguments(attention_where="where")
    def __call__(
        self,
        tokens: Int[ArrayLike, "B T"],
        where: Mask[ArrayLike, "B T"] | None = None,
        positions: Int[ArrayLike, "B T"] | Int[ArrayLike, "3 B T"] | None = None,
        segment_ids: Int[ArrayLike, "B T"] | None = None,
        *,
        return_router_logits: bool = False,
        routing: Int[ArrayLike, "M B T k"] | None = None,
        return_routing: bool = False,
        embeddings: Float[ArrayLike, "B T H"] | None = None,
        embeddings_where: Mask[ArrayLike, "B T"] | None = None,
        blocks: Int[ArrayLike, "B T"] | None = None,
    ) -> Float[Array, "B T H"] | tuple[Array, ...]:
        """Final-norm hidden states of every position (and the router logits, the routing).

        Args:
          tokens: `[B, T]` integer token ids in `[0, V)`; ids at padded positions are
            ignored and may be anything (for example -100).
          where: `[B, T]` mask, True (or 1) = a real token, False (or 0) = padding (left,
            right or anywhere). Padded keys are invisible to every query; outputs at padded
            positions are finite but meaningless. None means all real. Formerly
            `attention_where`, which still works for one release with a
            `DeprecationWarning`.
          positions: `[B, T]` integer RoPE positions. None means, per row, the number of real
            tokens before each position, `max(cumsum(where) - 1, 0)`, so a left-padded prompt
            gets positions 0, 1, ... on its real tokens; with `segment_ids`, the number of
            real tokens before it in its own segment (positions restart at 0 in each). With
            `config.mrope_section` they may be `[3, B, T]` (temporal, height, width:
            `tunelib.models.mrope_positions`).
          segment_ids: `[B, T]` integer ids of packed sequences: 1, 2, ... for the sequences
            of a row, each a contiguous run of columns, and 0 on padding (a token of segment
            0 is padding whatever `where` says). A query attends only to keys of its own
            segment, so every packed sequence gives the hidden states it gives alone. None
            means one sequence per row. Refused for a model with Gated DeltaNet layers
            (`config.linear_layers`), whose state would run across sequences.
          return_router_logits: also return the router logits of the $M$
            mixture-of-experts layers (`config.moe_layers`), for the auxiliary losses
            (`tunelib.losses.load_balancing_loss`, `tunelib.losses.router_z_loss`).
          routing: `[M, B, T, k]` integer expert ids to route each token to in each of the
            $M$ mixture-of-experts layers (routing replay, R3): a record from
            `tunelib.rollout.sample(..., record_routing=True)` or `return_routing`. The
            experts are taken from it; their gate weights are still computed, and
            differentiated, from this model's router logits (`tunelib.models.route` with
            `experts`). Dense layers ignore it. None (the default) routes by top-k.
          return_routing: also return the `[M, B, T, k]` int32 experts each token was routed
            to (under `routing`, those given).
          embeddings: `[B, T, H]` input embeddings that replace the (scaled) token
            embeddings where `embeddings_where` is True: a vision-language model's image
            features at its image tokens (`VisionLanguageModel`). The tokens there still give
            the per-layer inputs' token part (Gemma 4). None: token embeddings everywhere.
          embeddings_where: `[B, T]` mask, True where `embeddings` are taken; required with
            `embeddings`.
          blocks: `[B, T]` integer block ids, -1 outside any block: the sliding-window layers
            let the tokens of one block (an image's soft tokens) attend to each other both
            ways, within the window, as Gemma 4 does with `use_bidirectional_attention =
            "vision"`; full layers stay causal. None: causal everywhere.

        Returns:
          `[B, T, H]` hidden states in the compute dtype `config.dtype`; with
          `return_router_logits`, the pair of them and the `[M, B, T, E]` router logits
          (float32, float64 for a float64 model; $M = 0$ for a dense model); with
          `return_routing`, the `[M, B, T, k]` routing after them (k = 1 for a dense
          model).

        Raises:
          ValueError: when tracing, for a `routing` given to a model without
            mixture-of-experts layers, or of another shape than `[M, B, T, k]`; for a
            concrete one, an expert id outside `[0, E)` (a traced one gives NaN hidden
            states at that token: `route`).
        """
        c = self.config
        tokens = v.int_array(tokens, "tokens")
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [B, T], got {tokens.shape}.")
        where = v.mask_array(where, tokens.shape, "where")
        if segment_ids is not None and any(c.linear_layers):
            raise ValueError(
                "segment_ids (packed sequences) are not supported with 'linear_attention' "
                "layers: their recurrent state would run from one sequence into the next."
            )
        if segment_ids is not None:
            segment_ids = v.int_array(segment_ids, "segment_ids")
            v.check_shape(segment_ids, "segment_ids", tokens.shape, f"tokens {tokens.shape}")
            where = where & (segment_ids != 0)
        if positions is None:
            positions = _default_positions(where, segment_ids)
        else:
            positions = _checked_positions(positions, tokens.shape, c)
        if routing is not None:
            routing = checked_routing(routing, c, tokens.shape)
        soft = _soft_inputs(embeddings, embeddings_where, tokens.shape, c.hidden_size)

        high = v.compute_dtype(c.compute_dtype)
        allowed, fill = _attention_mask(where, segment_ids, high)
        t = jnp.arange(tokens.shape[1])
        masks = self._masks(allowed, fill, t, t)
        if blocks is not None:
            masks = self._with_blocks(masks, blocks, where, t, jnp.zeros((), jnp.int32), t)
        x, _, routed = self._run_layers(tokens, where, positions, masks, routing=routing, soft=soft)
        if not (return_router_logits or return_routing):
            return self.norm(x)
        if routed is None:
            routed = (
                jnp.zeros((0, *tokens.shape, max(c.num_experts, 1)), high),
                jnp.zeros((0, *tokens.shape, c.num_experts_per_tok), jnp.int32),
            )
        kept = (return_router_logits, return_routing)
        return (self.norm(x), *(out for out, keep in zip(routed, kept, strict=True) if keep))

    def init_cache(self, batch_size: int, length: int, *, windowed: bool = False) -> "KVCache":
        """An empty `KVCache` of `length` slots for `batch_size` rows, in the compute dtype.

        Args:
          batch_size: rows $B$.
          length: slots $S$, the most tokens (padding included) the cache will hold: the
            prompt length plus the number of tokens to decode.
          windowed: sliding-window layers (window $W$ slots) keep a ring of their $W$
            latest slots instead of all $S$, where that is fewer: the keys a query of
            theirs can see. `extend` gives the same hidden states either
            way, up to the order of the sums of attention (float32 rounding); the ring's
            keys are cached in groups of their own (see `KVCache`). Default False: every
            layer keeps all $S$ slots.
        """
        for name, value in (("batch_size", batch_size), ("length", length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        if not isinstance(windowed, bool):
            raise TypeError(f"windowed must be a bool, got {windowed!r}.")
        c = self.config
        conv = recurrent = None
        if any(c.linear_layers):  # the Gated DeltaNet layers' states
            count, k_c = sum(c.linear_layers), c.linear_conv_kernel_dim
            keys, values = c.linear_num_key_heads, c.linear_num_value_heads
            channels = 2 * keys * c.linear_key_head_dim + values * c.linear_value_head_dim
            conv = jnp.zeros((count, batch_size, k_c - 1, channels), c.compute_dtype)
            state = (count, batch_size, values, c.linear_key_head_dim, c.linear_value_head_dim)
            recurrent = jnp.zeros(state, v.compute_dtype(c.compute_dtype))
        groups = cache_groups(c, length, windowed)
        shapes = [(len(g.members), batch_size, g.kv_heads, g.slots) for g in groups]
        return KVCache(
            keys=tuple(
                jnp.zeros((*s, g.head_dim), c.compute_dtype)
                for s, g in zip(shapes, groups, strict=True)
            ),
            values=tuple(
                jnp.zeros((*s, g.value_dim), c.compute_dtype)
                for s, g in zip(shapes, groups, strict=True)
            ),
            where=jnp.zeros((batch_size, length), jnp.bool_),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            index=jnp.zeros((), jnp.int32),
            conv=conv,
            recurrent=recurrent,
        )

    @renamed_arguments(attention_where="where")
    def extend(
        self,
        tokens: Int[ArrayLike, "B T"],
        where: Mask[ArrayLike, "B T"] | None,
        cache: "KVCache",
        *,
        routing: Int[ArrayLike, "M B T k"] | None = None,
        return_routing: bool = False,
        embeddings: Float[ArrayLike, "B T H"] | None = None,
        embeddings_where: Mask[ArrayLike, "B T"] | None = None,
        blocks: Int[ArrayLike, "B T"] | None = None,
        positions: Int[ArrayLike, "B T"] | Int[ArrayLike, "3 B T"] | None = None,
    ) -> tuple[Float[Array, "B T H"], "KVCache"] | tuple[Array, "KVCache", Array]:
        """Hidden states of `T` new tokens per row, attending to the cache and each other.

        The new tokens' keys and values are written into slots `cache.index` to
        `cache.index + T - 1` and every query attends to the real cached tokens and the real
        new tokens at or before it. A real new token's RoPE position is the number of real
        tokens before it in its row (`cache.lengths` plus those before it in this call), so
        prefilling a padded prompt and then decoding one token at a time gives the hidden
        states of one uncached forward pass over the whole sequence (with default
        positions). Prefill is `extend(prompt, prompt_where, init_cache(B, S))`; a decode
        step is `extend(next_token[:, None], still_running[:, None], cache)`, where a False
        entry adds a padding slot that no query will see.

        Args:
          tokens: `[B, T]` token ids; ignored where `where` is False.
          where: `[B, T]` mask, True (or 1) = a real token; None means all real. Formerly
            `attention_where` (deprecated, still accepted for one release).
          cache: the `KVCache` from `init_cache` or a previous `extend`. Its index is
            traced, so writing past its last slot cannot be caught here: the caller sizes
            the cache (`tunelib.rollout.sample` checks it before compiling).
          routing: `[M, B, T, k]` experts to route the new tokens to (replay; see
            calling the model); None routes by top-k.
          return_routing: also return the `[M, B, T, k]` int32 experts the new tokens were
            routed to: what `tunelib.rollout.sample` records.
          embeddings: `[B, T, H]` input embeddings of the new tokens where
            `embeddings_where` (see calling the model).
          embeddings_where: `[B, T]` mask, required with `embeddings`.
          blocks: `[B, T]` block ids of the new tokens, -1 outside a block (see calling the
            model); a block lies within one call.
          positions: `[B, T]` (or, with `config.mrope_section`, `[3, B, T]`) RoPE positions
            of the new tokens instead of the default; the cache then continues from one past
            the largest real one of each row (`cache.lengths`): the prefill of a prompt with
            images at `tunelib.models.mrope_positions`, whose later tokens decode at their
            count plus the row's delta, as transformers' Qwen3.5 does.

        Returns:
          The `[B, T, H]` final-norm hidden states of the new tokens and the updated cache;
          with `return_routing`, the routing after them.
        """
        c = self.config
        tokens = v.int_array(tokens, "tokens")
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [B, T], got {tokens.shape}.")
        where = v.mask_array(where, tokens.shape, "where")
        b, t = tokens.shape
        slots = cache.where.shape[1]
        if cache.where.shape[0] != b:
            raise ValueError(f"tokens has {b} rows but the cache has {cache.where.shape[0]}.")
        if t > slots:
            raise ValueError(f"tokens has {t} positions but the cache only {slots} slots.")
        if routing is not None:
            routing = checked_routing(routing, c, tokens.shape)
        soft = _soft_inputs(embeddings, embeddings_where, tokens.shape, c.hidden_size)
        groups = _groups_of(c, cache)
        counts = jnp.cumsum(where, axis=-1, dtype=jnp.int32)
        if positions is None:
            positions = cache.lengths[:, None] + jnp.maximum(counts - 1, 0)
            lengths = cache.lengths + counts[:, -1]
        else:
            positions = _checked_positions(positions, tokens.shape, c)
            top = jnp.where(where, positions if positions.ndim == 2 else positions.max(0), -1)
            lengths = jnp.maximum(cache.lengths, top.max(axis=-1) + 1).astype(jnp.int32)
        key_where = jax.lax.dynamic_update_slice_in_dim(cache.where, where, cache.index, 1)
        query_slots = cache.index + jnp.arange(t)
        causal = jnp.arange(slots)[None, :] <= query_slots[:, None]  # [T, S]
        allowed = rearrange(causal & key_where[:, None, :], "b t s -> b 1 1 t s")
        high = v.compute_dtype(c.compute_dtype)
        lowest = jnp.finfo(high).min
        fill = jnp.where(causal, 0.5 * lowest, lowest).astype(high)
        masks = self._masks(allowed, fill, query_slots, jnp.arange(slots))
        key_slots = jnp.arange(slots)
        for group in groups:  # a ring: its sliding layers attend over it and the new tokens
            if group.window is not None:
                masks[True] = ring_mask(key_where, cache.index, t, group.slots, group.window, high)
                key_slots = ring_key_slots(cache.index, t, group.slots)
        if blocks is not None:
            masks = self._with_blocks(masks, blocks, where, query_slots, cache.index, key_slots)
        linear = None if cache.conv is None else (cache.conv, cache.recurrent, where)
        x, (keys, values, *states), routed = self._run_layers(
            tokens,
            where,
            positions,
            masks,
            (cache.keys, cache.values, cache.index, groups, linear),
            routing,
            soft,
        )
        cache = KVCache(keys, values, key_where, lengths, cache.index + t, *states)
        if not return_routing:
            return self.norm(x), cache
        if routed is None:
            routed = (None, jnp.zeros((0, b, t, c.num_experts_per_tok), jnp.int32))
        return self.norm(x), cache, routed[1]

    def decoding_layout(self, params: PyTree) -> PyTree:
        """The pure-dict `params` of this model with the dense weights of its stacked layers
        held one array per layer, for a decode loop; `params` themselves when the layers are
        not stacked.

        With `config.scan_layers`, a product by one layer's slice of a stacked `[L, ...]`
        weight inside the loop over layers makes XLA copy the slice out of the stack first,
        every time the layers run: at every token of a decode loop, a copy of all the layer
        weights. In the parameters returned each stacked `Dense` kernel is `L` arrays (one
        copy, made here; the layers' other weights stay stacked), and a model merged from
        them runs its layers in a loop whose products pick their layer's array with
        `lax.switch`, so they read it where it lies. That model computes exactly what this
        one computes, and compiles one layer's body as the scan does, plus one product per
        layer in each switch (not the $L$ layers of `scan_layers=False`); the dense layer
        weights are held twice while both sets of parameters live. `tunelib.rollout` samples
        with it. Only the structure of this model is read (it may be abstract). Under
        `tunelib.peft.lora` (adapted or quantised weights) `params` are returned as they are.

        Args:
          params: the model's parameters as a pure dict (`nnx.to_pure_dict`).

        Returns:
          The parameters to merge with this model's graphdef.

        Examples:
          >>> import jax.numpy as jnp
          >>> from flax import nnx
          >>> from tunelib.models import Decoder, DecoderConfig
          >>> cfg = DecoderConfig(
          ...     vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
          ...     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          ...     scan_layers=True,
          ... )
          >>> graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
          >>> model = nnx.merge(graphdef, state)
          >>> decoding = nnx.merge(graphdef, model.decoding_layout(nnx.to_pure_dict(state)))
          >>> cache = model.init_cache(1, 8)
          >>> _, cache = model.extend(jnp.array([[3, 5, 7]]), None, cache)
          >>> scanned, _ = model.extend(jnp.array([[9]]), None, cache)
          >>> per_layer, _ = decoding.extend(jnp.array([[9]]), None, cache)
          >>> print(bool((scanned == per_layer).all()))
          True
        """
        if not self.config.scan_layers or products_must_be_plain():
            return params
        params = jax.tree.map(lambda x: x, params)  # new dicts, the same arrays
        stacks = stacks_of(self.config, self.layers)
        roots = [params["layers"]] if len(stacks) == 1 else list(params["layers"].values())
        for root, stack in zip(roots, stacks, strict=True):
            for path, module in nnx.iter_modules(stack):
                if not isinstance(module, Dense):
                    continue
                node = root
                for key in path:
                    node = node[key]
                if isinstance(node["kernel"], jax.Array):
                    node["kernel"] = PerLayer.unstack(node["kernel"])
        return params

    def _masks(self, allowed, fill, query_slots, key_slots) -> dict[bool, tuple]:
        """`(allowed [B, 1, 1, T, S], fill [T, S])` for the layer kinds present: `True`
        (sliding, within the window) and `False` (full)."""
        c = self.config
        masks = {}
        for sliding in set(c.sliding_layers):
            window = _in_window(query_slots, key_slots, c.sliding_window) if sliding else True
            masks[sliding] = (allowed & window, fill)
        return masks

    def _with_blocks(self, masks, blocks, where, query_slots, index, key_slots) -> dict:
        """`masks` with the sliding layers' queries also seeing the real keys of their own
        block (`blocks` `[B, T]` of the new tokens at slots `index + j`), within the window;
        `key_slots` `[S]` is the slot of each key column (negative: none)."""
        blocks = v.int_array(blocks, "blocks")
        v.check_shape(blocks, "blocks", where.shape, f"tokens {where.shape}")
        if True not in masks:
            return masks
        blocks = jnp.where(where, blocks, -1)
        new = key_slots - index  # which new token each key column holds, if any
        inside = (new >= 0) & (new < blocks.shape[1])
        key_blocks = jnp.where(inside, jnp.take(blocks, jnp.clip(new, 0, None), axis=1), -1)
        same = (blocks[:, :, None] == key_blocks[:, None, :]) & (blocks[:, :, None] >= 0)
        window = _in_window(query_slots, key_slots, self.config.sliding_window)
        allowed, fill = masks[True]
        extra = rearrange(same & window, "b t s -> b 1 1 t s")
        return {**masks, True: (allowed | extra, fill)}

    def _run_layers(self, tokens, where, positions, masks, cache=None, routing=None, soft=None):
        """The embedded tokens through every layer; with a cache `(keys, values, index,
        groups)` (its `CacheGroup`s), also the new keys and values of each cache group; and
        the mixture-of-experts layers' `([M, B, T, E] router logits, [M, B, T, k] experts)`,
        or None. `routing` `[M, B, T, k]` replays experts in those layers.

        `masks` maps each layer kind (sliding or not) to its `(allowed, fill)` (over a ring
        and the new tokens for the sliding layers of a windowed cache); each kind rotates by
        its own RoPE (`rope_local_base_freq` for sliding layers, when set) at its own head
        width."""
        c = self.config
        high = v.compute_dtype(c.compute_dtype)
        inputs = {}
        for sliding, mask in masks.items():
            local = sliding and c.rope_local_base_freq is not None
            theta, scaling = (
                (c.rope_local_base_freq, None) if local else (c.rope_theta, c.rope_scaling)
            )
            head_dim = c.head_dim if sliding else (c.global_head_dim or c.head_dim)
            if c.partial_rotary_factor != 1:
                head_dim = c.rotary_dim
            frequencies = rope_frequencies(head_dim, theta=theta, scaling=scaling)
            scale = rope_attention_factor(scaling)
            if positions.ndim == 3:
                axes = mrope_axes(c.mrope_section, len(frequencies))
                angles = mrope_angles(positions, frequencies, axes, high)
            else:
                angles = rope_angles(positions, frequencies, high, scale)
            inputs[sliding] = (*angles, *mask)
        embedding = self.embed_tokens.embedding[...]
        ids = jnp.where(where, tokens, 0)
        x = jnp.take(embedding, ids, axis=0)
        if c.scale_embeddings:
            x = x * jnp.asarray(c.hidden_size**0.5, embedding.dtype)
        x = x.astype(c.compute_dtype)
        if soft is not None:
            values, taken = soft
            x = jnp.where(taken[..., None], values.astype(c.compute_dtype), x)
        per_layer = self._per_layer_inputs(ids, x) if c.hidden_size_per_layer_input else None
        keys, values, index, groups, linear = (None,) * 5 if cache is None else cache

        def run(layer, x, cos, sin, allowed, fill, layer_cache, shared, per_layer_input, routing):
            return layer(x, cos, sin, allowed, fill, layer_cache, shared, per_layer_input, routing)

        if c.remat:
            run = nnx.remat(run)
        if not c.scan_layers:
            return self._loop(
                run, x, inputs, per_layer, keys, values, index, groups, routing, linear
            )

        cached = None if cache is None else (keys, values, index, groups)
        return run_stacks(c, self.layers, run, x, inputs, cached, routing)

    def _loop(self, run, x, inputs, per_layer, keys, values, index, groups, routing, linear):
        """The layers one after another, each reading and writing its cache group's slot and
        handing its keys and values to the layers that share them; a Gated DeltaNet layer
        reads and writes its state in `linear` (`(conv, recurrent, where)`, the states of
        every such layer stacked, or None)."""
        c = self.config
        conv, recurrent, new_where = (None,) * 3 if linear is None else linear
        order = {i: n for n, i in enumerate(i for i, is_linear in enumerate(c.linear_layers)
                                            if is_linear)}  # fmt: skip
        keys, values = (None, None) if keys is None else (list(keys), list(values))
        slots = {
            layer: (g, j)
            for g, group in enumerate(groups or ())
            for j, layer in enumerate(group.members)
        }
        consumers = {source for i, source in enumerate(c.kv_sources) if source != i}
        attended, routed = {}, []
        for i, (layer, sliding) in enumerate(zip(self.layers, c.sliding_layers, strict=True)):
            source = c.kv_sources[i]
            layer_cache = None
            if c.linear_layers[i] and conv is not None:
                n = order[i]
                layer_cache = DeltaNetState(conv[n], recurrent[n], new_where)
            elif source == i and keys is not None:
                g, j = slots[i]
                ring = groups[g].window is not None
                layer_cache = LayerCache(keys[g], values[g], j, index, ring=ring)
            shared = attended.get(source) if source != i else None
            per_layer_input = None if per_layer is None else per_layer[:, :, i]
            replayed = None if routing is None or not c.moe_layers[i] else routing[len(routed)]
            x, layer_cache, layer_routed, kv = run(
                layer, x, *inputs[sliding], layer_cache, shared, per_layer_input, replayed
            )
            if isinstance(layer_cache, DeltaNetState):
                conv = conv.at[n].set(layer_cache.conv)
                recurrent = recurrent.at[n].set(layer_cache.recurrent)
            elif layer_cache is not None:
                keys[g], values[g] = layer_cache.keys, layer_cache.values
            if i in consumers:
                attended[i] = kv
            routed += [] if layer_routed is None else [layer_routed]
        stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *routed) if routed else None
        new = None if keys is None else (tuple(keys), tuple(values))
        if new is not None and linear is not None:
            new = (*new, conv, recurrent)
        return x, new, stacked

    def _per_layer_inputs(self, ids: jax.Array, x: jax.Array) -> jax.Array:
        """Gemma 4's per-layer inputs `[B, T, L, P]` of the tokens `ids` with (scaled)
        embeddings `x` (see `DecoderConfig.hidden_size_per_layer_input`)."""
        c = self.config
        p = c.hidden_size_per_layer_input
        shape = (*ids.shape, c.num_hidden_layers, p)
        table = self.embed_tokens_per_layer.embedding[...]
        token_part = jnp.take(table, ids, axis=0) * jnp.asarray(p**0.5, table.dtype)
        projected = self.per_layer_model_projection(x) * jnp.asarray(
            c.hidden_size**-0.5, c.compute_dtype
        )
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        summed = projected + token_part.reshape(shape).astype(c.compute_dtype)
        return summed * jnp.asarray(2**-0.5, c.compute_dtype)

    def unembedding(self) -> Float[Array, "H V"]:
        """The `[H, V]` unembedding matrix $U$ in the compute dtype.

        The transposed token embedding when `config.tie_word_embeddings`, else `lm_head`'s
        kernel. `hidden @ unembedding()` are the logits (see `unembed`).
        """
        dtype = self.config.compute_dtype
        if self.lm_head is None:
            return self.embed_tokens.embedding[...].T.astype(dtype)
        return self.lm_head.kernel[...].astype(dtype)

    def unembed(self, hidden: Float[ArrayLike, "*B H"]) -> Float[Array, "*B V"]:
        """Logits `hidden @ unembedding()`, accumulated and returned in at least float32.

        With `config.final_logit_softcapping` $c$ they are $c \tanh(l / c)$ of those; the
        fused heads of `tunelib.logprobs` take the same $c$ as `softcap`.

        Args:
          hidden: `[..., H]` hidden states, as returned by calling the model.

        Returns:
          `[..., V]` logits, float32 (float64 when `config.dtype` is float64), so log-probs
          of a bfloat16 model are not computed from bfloat16-rounded logits.
        """
        hidden = v.float_array(hidden, "hidden")
        h = self.config.hidden_size
        if hidden.ndim < 1 or hidden.shape[-1] != h:
            raise ValueError(f"hidden must have shape [..., {h}], got {hidden.shape}.")
        dtype = self.config.compute_dtype
        logits = jnp.matmul(
            hidden.astype(dtype),
            self.unembedding(),
            preferred_element_type=v.compute_dtype(dtype),
        )
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)


class KVCache(NamedTuple):
    """The keys and values of every layer for the tokens decoded so far.

    A pytree of arrays (it passes through `jax.jit` and `lax.while_loop`), created by
    `Decoder.init_cache` and advanced by `Decoder.extend`. All rows share the slot index;
    padding occupies slots that no query sees. Layers are cached in groups of one shape
    (key/value heads $K$, head width $D$): one group for most models, two for Gemma 4, whose
    full-attention layers are wider; layers that share another layer's keys and values
    (`DecoderConfig.num_kv_shared_layers`) have no entry. In a windowed cache
    (`init_cache(..., windowed=True)`) the sliding-window layers (window $W$) form groups of
    their own whose slot axis is a ring of $R = W$ slots (slot $s$ at position
    $s \bmod R$), where that is fewer than $S$.

    Attributes:
      keys: one `[L_g, B, K_g, S, D_g]` array of RoPE-rotated keys per group (`S` is `R`
        for a ring), in the compute dtype; the group's layers in order. Heads before slots:
        the layout both attention matmuls read without a transpose.
      values: the values, shaped as `keys` (for multi-head latent attention, with no
        channels: its keys are the cached latent and the rotated key, and its values the
        latent's first `kv_lora_rank` channels).
      where: `[B, S]` True where a slot holds a real token.
      lengths: `[B]` the RoPE position of the next real token of each row: its real tokens
        so far, or one past its largest position after an `extend` with `positions`.
      index: the next slot to write, a scalar shared by every row.
      conv: for a model with Gated DeltaNet layers (`DecoderConfig.linear_layers`), the
        last `K_c - 1` inputs of each one's convolution, `[L_n, B, K_c - 1, C]` in the
        compute dtype, its layers in order; else None.
      recurrent: their delta-rule states `[L_n, B, h_v, d_k, d_v]`, float32 at least; else
        None. These layers keep no keys or values.
    """

    keys: tuple[Float[Array, "_ B _ S _"], ...]
    values: tuple[Float[Array, "_ B _ S _"], ...]
    where: Bool[Array, "B S"]
    lengths: Int[Array, " B"]
    index: Int[Array, ""]
    conv: Float[Array, "_ B _ _"] | None = None
    recurrent: Float[Array, "_ B _ _ _"] | None = None

    def repeat_rows(self, count: int) -> "KVCache":
        """The cache with each row repeated `count` times: row `b * count + g` continues row
        `b` (one prefilled prompt forked into `count` completions)."""

        def repeat(x, axis):
            return jnp.repeat(x, count, axis=axis)

        return KVCache(
            tuple(repeat(k, 1) for k in self.keys),
            tuple(repeat(x, 1) for x in self.values),
            repeat(self.where, 0),
            repeat(self.lengths, 0),
            self.index,
            None if self.conv is None else repeat(self.conv, 1),
            None if self.recurrent is None else repeat(self.recurrent, 1),
        )


def _groups_of(config: DecoderConfig, cache: "KVCache") -> list[CacheGroup]:
    """The `CacheGroup`s of `cache`: windowed when a group's slot axis is shorter than the
    cache (a ring), else every layer's full. A ValueError when its keys are neither."""
    slots = cache.where.shape[1]
    windowed = any(k.ndim == 5 and k.shape[3] != slots for k in cache.keys)
    groups = cache_groups(config, slots, windowed)
    expected = [(len(g.members), g.kv_heads, g.slots, g.head_dim) for g in groups]
    found = [(k.shape[0], *k.shape[2:]) if k.ndim == 5 else k.shape for k in cache.keys]
    if found != expected:
        raise ValueError(
            f"cache.keys are [L, B, K, S, D] arrays with (L, K, S, D) {found}, but this model "
            f"caches {expected} in {slots} slots{' (windowed)' if windowed else ''}: "
            "make the cache with this model's init_cache."
        )
    return groups


def _soft_inputs(embeddings, embeddings_where, shape, width):
    """`(embeddings [B, T, H], where [B, T])` checked, or None without embeddings."""
    if embeddings is None:
        if embeddings_where is not None:
            raise ValueError("embeddings_where is given without embeddings.")
        return None
    embeddings = v.float_array(embeddings, "embeddings")
    v.check_shape(embeddings, "embeddings", (*shape, width), f"[B, T, H] = {(*shape, width)}")
    if embeddings_where is None:
        raise ValueError("embeddings needs embeddings_where, the [B, T] mask of where it is taken.")
    return embeddings, v.mask_array(embeddings_where, shape, "embeddings_where")


def _checked_positions(positions: ArrayLike, shape: tuple[int, int], config) -> jax.Array:
    """`positions` as an int array of shape `[B, T]`, or `[3, B, T]` under M-RoPE."""
    positions = v.int_array(positions, "positions")
    if positions.ndim == 3 and config.mrope_section is not None:
        v.check_shape(positions, "positions", (3, *shape), f"[3, B, T] for tokens {shape}")
    else:
        v.check_shape(positions, "positions", shape, f"tokens {shape}")
    return positions


def _default_positions(where: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Each token's RoPE position: the real tokens before it in its row, or in its segment.

    With `segment_ids`, a segment starts where the id changes from the column before; the
    real tokens before its start are subtracted, so positions restart at 0 in each segment.
    """
    counts = jnp.cumsum(where, axis=-1, dtype=jnp.int32)  # real tokens up to and with t
    if segment_ids is not None:
        before = counts - where  # real tokens strictly before t
        first = jnp.ones_like(segment_ids[:, :1], jnp.bool_)
        starts = jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
        # `before` never decreases, so the running max is its value at the latest start.
        counts = counts - jax.lax.cummax(jnp.where(starts, before, 0), axis=1)
    return jnp.maximum(counts - 1, 0)


def _attention_mask(
    where: jax.Array, segment_ids: jax.Array | None, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """Which keys each query sees, `[B, 1, 1, T, S]`, and the scores of the others, `[T, S]`.

    A query sees the real keys of its own segment at or before it (a sliding layer also
    needs them within its window: `Decoder._masks`). The scores of unseen keys are finite, so a
    padded query with no visible key still gives finite outputs; future keys score far below
    padded ones, so such a query attends to the padded keys before it and stays causal.
    """
    t = where.shape[-1]
    causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
    allowed = causal & where[:, None, :]
    if segment_ids is not None:
        allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
    lowest = jnp.finfo(dtype).min
    fill = jnp.where(causal, 0.5 * lowest, lowest).astype(dtype)
    return rearrange(allowed, "b t s -> b 1 1 t s"), fill  # over kv heads, groups


def _in_window(query_slots: jax.Array, key_slots: jax.Array, window: int) -> jax.Array:
    """`[T, S]`: True where key slot s lies less than `window` slots before query slot t."""
    return key_slots[None, :] > query_slots[:, None] - window
