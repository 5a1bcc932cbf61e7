"""The building blocks of the decoder: RMSNorm, dense projections, attention, SwiGLU.

Every weight is an `nnx.Param` whose `out_sharding` metadata names its axes with logical names
(see `docs/models.md`); map them to mesh axes with `nnx.logical_axis_rules` and read the
partitioning with `nnx.get_partition_spec`. The names are annotations only: parameters are
created unsharded (`eager_sharding=False`) whatever mesh is current.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx
from jax.custom_derivatives import SymbolicZero

from tunelib import _validation as v
from tunelib._products import products_are_blocked
from tunelib.models._config import DecoderConfig
from tunelib.models._per_layer import LayerWeight
from tunelib.models._qwen_vision_config import QwenVisionConfig
from tunelib.models._rope import apply_rope
from tunelib.models._vision_config import VisionConfig
from tunelib.models._windowed import (
    KindCaches,
    LayerCache,
    reads_before_writing,
    ring_keys,
    write,
)

# The configs the shared blocks (`kernel_init`, `RMSNorm`, `Dense`) read their dtypes from.
AnyConfig = DecoderConfig | VisionConfig | QwenVisionConfig
Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]
_BUCKET, _MAX_BUCKETS = 32, 8
# The widest block of input features a float32 product on CPU accumulates in one run (`Dense`).
_BLOCK = 192


def param(
    rngs: nnx.Rngs,
    init: Initializer,
    shape: tuple[int, ...],
    names: tuple[str | None, ...],
    dtype: jnp.dtype,
) -> nnx.Param:
    """A parameter of `shape` drawn from `init`, annotated with the logical axis `names`."""
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)


def kernel_init(config: AnyConfig) -> Initializer:
    return jax.nn.initializers.normal(config.initializer_range)


class RMSNorm(nnx.Module):
    r"""Root-mean-square normalisation over the last axis, with a learned scale.

    $y = \mathrm{cast}\big(x / \sqrt{\mathrm{mean}(x^2) + \epsilon}\big) \odot g$: the
    statistic and the division run in at least float32; the result is cast to the compute
    dtype before the scale $g$ multiplies it (as Meta's Llama and Hugging Face do). With
    `config.norm_offset` (Gemma) it is $\mathrm{cast}\big(\hat x \odot (1 + g)\big)$
    instead, the product in float32, and $g$ starts at 0. With `scaled=False` there is no
    $g$ (Gemma 4's value norm and router norm); `eps` overrides `config.rms_norm_eps`.
    """

    def __init__(
        self,
        dim: int,
        name: str | None,
        config: AnyConfig,
        *,
        scaled: bool = True,
        eps: float | None = None,
        rngs: nnx.Rngs,
    ):
        self.eps = config.rms_norm_eps if eps is None else eps
        self.offset = config.norm_offset
        self.dtype = config.compute_dtype
        init = jax.nn.initializers.zeros if self.offset else jax.nn.initializers.ones
        self.scale = param(rngs, init, (dim,), (name,), config.storage_dtype) if scaled else None

    def __call__(self, x: jax.Array) -> jax.Array:
        high = x.astype(v.compute_dtype(x.dtype))
        normed = high * jax.lax.rsqrt(jnp.mean(high * high, axis=-1, keepdims=True) + self.eps)
        if self.scale is None:
            return normed.astype(self.dtype)
        if self.offset:
            return (normed * (1 + self.scale[...].astype(high.dtype))).astype(self.dtype)
        return normed.astype(self.dtype) * self.scale[...].astype(self.dtype)


class Embedding(nnx.Module):
    """A `[V, H]` table of token embeddings (or `[V, width]`, named `names`)."""

    def __init__(
        self,
        config: DecoderConfig,
        *,
        width: int | None = None,
        names: tuple[str, str] = ("vocab", "embed"),
        rngs: nnx.Rngs,
    ):
        shape = (config.vocab_size, width or config.hidden_size)
        init = kernel_init(config)
        self.embedding = param(rngs, init, shape, names, config.storage_dtype)


class Dense(nnx.Module):
    """`x @ kernel (+ bias)` with `kernel` stored `[in, out]`.

    In float32 on CPU (JAX's default backend) the product is summed over blocks of at most
    192 input features, each block's partial product from one batched matmul and the partials
    added pairwise; the gradient takes the plain products. XLA's CPU matmul accumulates the
    whole contraction in one run and rounds 1.5 times as much as PyTorch's (MKL sums blocks
    of 192): over SmolLM2-135M's 30 layers that left tunelib's float32 logits 1.2 to 3.9
    times as far from the float64 ones as `transformers`', and 0.8 to 1.4 times with the
    blocks, for 6 % of a CPU forward pass (`docs/models.md`). Other dtypes and backends, and
    LoRA or quantised kernels under `tunelib.peft.lora` (their own product rule computes
    them), take the plain product; so does a program traced inside
    `tunelib._products.unblocked_products()` (the sampler's `products="plain"`: one dot a
    product is much faster at many rows on CPU).
    """

    def __init__(
        self,
        features_in: int,
        features_out: int,
        names: tuple[str | None, str | None],
        config: AnyConfig,
        *,
        use_bias: bool,
        rngs: nnx.Rngs,
    ):
        self.dtype = config.compute_dtype
        shape = (features_in, features_out)
        self.kernel = param(rngs, kernel_init(config), shape, names, config.storage_dtype)
        self.bias = (
            param(rngs, jax.nn.initializers.zeros, (features_out,), names[1:], config.storage_dtype)
            if use_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        y = _matmul(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def _matmul(x: jax.Array, kernel: jax.Array | LayerWeight) -> jax.Array:
    """`x @ kernel`, blocked over the contraction in float32 on CPU (see `Dense`).

    The backend is JAX's default one, read at trace time: `jax.lax.platform_dependent` would
    choose at compile time, but under `jax.grad` its conditional keeps more of the forward
    pass for the backward one (1.5 times the temporaries of SmolLM2-135M's gradient).
    """
    blocks = _block_count(x.shape[-1])
    # A JAX array or tracer; a Quax tracer (an adapted or quantised weight) reshaped would be
    # materialised, so it keeps the one product its own rule knows. Inside a scan over stacked
    # layers such a weight is traced as a plain array: `peft.lora` says so (tunelib._products),
    # as the sampler's `products="plain"` does by choice.
    # A `LayerWeight` (one layer's among per-layer arrays) runs only the products in its
    # per-layer branches: everything else is traced once.
    per_layer = isinstance(kernel, LayerWeight)
    plain = per_layer or type(kernel).__module__.startswith(("jax.", "jaxlib."))
    if (
        blocks == 1
        or not plain
        or not products_are_blocked()
        or x.dtype != jnp.float32
        or kernel.dtype != jnp.float32
        or jax.default_backend() != "cpu"
    ):
        return kernel.product(jnp.matmul, x) if per_layer else x @ kernel
    if per_layer:
        return _pairwise_sum(kernel.product(_block_products, _x_blocks(x, blocks)))
    return _blocked_matmul(x, kernel, blocks)


def _block_count(features: int) -> int:
    """Blocks of equal width, at most `_BLOCK` and at least half of it, over `features`; 1
    (no blocking) when `features` fits in one block or has no such divisor."""
    for blocks in range(-(-features // _BLOCK), features // (_BLOCK // 2) + 1):
        if features % blocks == 0:
            return blocks
    return 1


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _blocked_matmul(x: jax.Array, kernel: jax.Array, blocks: int) -> jax.Array:
    r"""`x [..., K] @ kernel [K, N]` as $\sum_c x_c W_c$ over `blocks` equal blocks of the $K$
    input features: one batched matmul gives the partial products, added pairwise.

    The kernel's blocks are a reshape of it (no copy); `x`'s are one transposed copy. Only the
    value is blocked: its derivatives are the plain products, as fast as without blocking.
    """
    return _pairwise_sum(_block_products(_x_blocks(x, blocks), kernel))


def _x_blocks(x: jax.Array, blocks: int) -> jax.Array:
    """`x [..., K]` as `[C, ..., K / C]`, its `blocks` blocks of input features."""
    return rearrange(x, "... (c k) -> c ... k", c=blocks)


def _block_products(x_blocks: jax.Array, kernel: jax.Array) -> jax.Array:
    """The `[C, ..., N]` partial products of `x_blocks [C, ..., K / C]` by the kernel's blocks
    of rows (a reshape of it, no copy): one batched matmul."""
    c = x_blocks.shape[0]
    return jnp.einsum("c...k,ckn->c...n", x_blocks, rearrange(kernel, "(c k) n -> c k n", c=c))


def _pairwise_sum(parts: jax.Array) -> jax.Array:
    """The sum over the leading axis of `parts`, added pairwise."""
    parts = list(parts)
    while len(parts) > 1:
        pairs = [a + b for a, b in zip(parts[::2], parts[1::2], strict=False)]
        parts = pairs + parts[len(pairs) * 2 :]
    return parts[0]


def _blocked_matmul_jvp(blocks, primals, tangents):
    """The blocked value; the tangent `dx @ kernel + x @ dkernel` by plain products (terms with
    a symbolic-zero tangent left out), so that its transpose, the gradient, is plain too."""
    (x, kernel), (dx, dkernel) = primals, tangents
    out = _blocked_matmul(x, kernel, blocks)
    terms = [] if isinstance(dx, SymbolicZero) else [dx @ kernel]
    terms += [] if isinstance(dkernel, SymbolicZero) else [x @ dkernel]
    return out, sum(terms[1:], terms[0]) if terms else jnp.zeros_like(out)


_blocked_matmul.defjvp(_blocked_matmul_jvp, symbolic_zeros=True)


class Attention(nnx.Module):
    r"""Grouped-query self-attention with RoPE, optional biases, QK-norm, value norm and
    attention sinks.

    Layer `index` of `config` takes its head width and key/value heads from
    `config.layer_head_dims` / `config.layer_kv_heads`. A layer whose `config.kv_sources`
    entry is another layer has no key or value projections: it is given that layer's keys
    and values. With `config.attention_k_eq_v`, a full-attention layer's values are its key
    projection (no `v_proj`). With `config.attention_sinks` each query head has a learned
    logit `sinks[n]` in its softmax's denominator (gpt-oss). With
    `config.attention_output_gate` (Qwen3.5) `q_proj` gives each head its queries and a gate
    $g$, and the heads' outputs are multiplied by $\sigma(g)$ before `o_proj`; with
    `config.partial_rotary_factor` below 1 only the first `config.rotary_dim` channels of each
    query and key head are rotated.
    """

    def __init__(self, config: DecoderConfig, index: int = 0, *, rngs: nnx.Rngs):
        c = config
        d, kv_heads = c.layer_head_dims[index], c.layer_kv_heads[index]
        self.num_kv_heads, self.head_dim = kv_heads, d
        self.dtype = c.compute_dtype
        q_width, kv_width = c.num_attention_heads * d, kv_heads * d
        bias = c.attention_bias
        self.output_gate = c.attention_output_gate
        self.rotary_dim = d if c.partial_rotary_factor == 1 else c.rotary_dim
        # Created in this order so that a seed draws the same weights as it always has.
        gated_width = q_width * (2 if self.output_gate else 1)
        self.q_proj = Dense(
            c.hidden_size, gated_width, ("embed", "q_heads"), c, use_bias=bias, rngs=rngs
        )
        self.shares_kv = c.kv_sources[index] != index
        k_eq_v = c.attention_k_eq_v and not c.sliding_layers[index]
        if not self.shares_kv:
            self.k_proj = Dense(
                c.hidden_size, kv_width, ("embed", "kv_heads"), c, use_bias=bias, rngs=rngs
            )
            self.v_proj = (
                None
                if k_eq_v
                else Dense(
                    c.hidden_size, kv_width, ("embed", "kv_heads"), c, use_bias=bias, rngs=rngs
                )
            )
        self.o_proj = Dense(
            q_width, c.hidden_size, ("q_heads", "embed"), c, use_bias=c.o_proj_bias, rngs=rngs
        )
        self.q_norm = RMSNorm(d, "head_dim", c, rngs=rngs) if c.use_qk_norm else None
        if not self.shares_kv:
            self.k_norm = RMSNorm(d, "head_dim", c, rngs=rngs) if c.use_qk_norm else None
            self.v_norm = (
                RMSNorm(d, "head_dim", c, scaled=False, rngs=rngs) if c.value_norm else None
            )
        self.scale = (c.query_pre_attn_scalar or d) ** -0.5
        self.softcap = c.attn_logit_softcapping
        # One logit per query head, replicated (a head count need not divide a mesh axis).
        self.sinks = (
            param(rngs, kernel_init(c), (c.num_attention_heads,), (None,), c.storage_dtype)
            if c.attention_sinks
            else None
        )

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        allowed: jax.Array | tuple[jax.Array, jax.Array],
        fill: jax.Array | tuple[jax.Array, jax.Array],
        cache: LayerCache | KindCaches | None = None,
        shared: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, LayerCache | KindCaches | None, tuple[jax.Array, jax.Array]]:
        """Attention of `x [B, T, H]`; with a `cache`, over the cached keys and these.

        `cache` is a `LayerCache`: the `[L, B, K, S, D]` keys and values of every layer that
        shares this layer's shape, this layer's index in them, and the slot at which this
        call's `T` keys and values are written. The queries then attend over this layer's
        slots up to the last one written, rounded up to a bucket (`cache_buckets`;
        `allowed` is `[B, 1, 1, T, S]`); for a ring (a windowed cache, `_windowed`) over the
        ring's `R` slots followed by the `T` new ones (`allowed` `[B, 1, 1, T, R + T]`).
        Writing into the whole-model arrays, rather than into a slice of them, lets XLA
        update the cache in place inside a decode loop. `KindCaches` (stacked layers of two
        kinds) holds a full cache and a ring, `allowed` and `fill` a pair for them. A layer
        that shares keys and values gets them as `shared` (and no cache). Returns the output,
        the updated cache (None without one) and the keys and values attended over.
        """
        d = self.head_dim
        gate = None
        if self.output_gate:  # per head: d query channels, then d gate channels
            q, gate = rearrange(self.q_proj(x), "b t (n two d) -> two b t n d", two=2, d=d)
            gate = rearrange(gate, "b t n d -> b t (n d)")
        else:
            q = rearrange(self.q_proj(x), "b t (n d) -> b t n d", d=d)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = self._rotated(q, cos, sin)
        if self.shares_kv:
            k, val = shared
        else:
            k = rearrange(self.k_proj(x), "b t (k d) -> b t k d", d=d)
            val = (
                k if self.v_proj is None else rearrange(self.v_proj(x), "b t (k d) -> b t k d", d=d)
            )
            if self.k_norm is not None:
                k = self.k_norm(k)
            if self.v_norm is not None:
                val = self.v_norm(val)
            k = self._rotated(k, cos, sin)
            # Attended in `[B, K, S, D]`, the cache's own layout, so that neither attention
            # matmul needs an operand transposed.
            k = rearrange(k, "b t k d -> b k t d")
            val = rearrange(val, "b t k d -> b k t d")
        # Query head n = k * groups + g reads key/value head k (grouped-query attention).
        q = rearrange(q, "b t (k g) d -> b k g t d", k=self.num_kv_heads)
        if cache is None:
            out = self._attend(q, k, val, allowed, fill)
        elif isinstance(cache, KindCaches):
            out, cache = self._attend_either_kind(q, k, val, cache, allowed, fill)
        else:
            out, cache, (k, val) = self._attend_cached(q, k, val, cache, allowed, fill)
        out = rearrange(out, "b k g t d -> b t (k g d)")
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        return self.o_proj(out), cache, (k, val)

    def _rotated(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """`x [B, T, heads, D]` with RoPE on its first `rotary_dim` channels."""
        r = self.rotary_dim
        if r == x.shape[-1]:
            return apply_rope(x, cos, sin)
        return jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)

    def _attend_cached(self, q, k, val, cache: LayerCache, allowed, fill):
        """Write the block's keys and values into `cache` and attend over it: the output, the
        cache and the keys and values attended over."""
        before = reads_before_writing(cache, k.shape[2])
        written = cache if before else write(cache, k, val)
        out = self._attend_written(q, k, val, written, allowed, fill, before)
        if before:
            return out, write(cache, k, val), ring_keys(cache, k, val)
        return out, written, (written.keys[written.layer], written.values[written.layer])

    def _attend_either_kind(self, q, k, val, caches: KindCaches, allowed, fill):
        """`_attend_cached` on the cache of the layer's kind (`caches.kind`, traced), each kind
        with its own mask of `allowed` and `fill`. Both caches are written, the other kind's
        with what it holds, and only the attention is a `lax.switch`, reading them: a switch
        that returned the caches would copy them at every layer."""
        before = [reads_before_writing(c, k.shape[2]) for c in caches.caches]
        enabled = [caches.kind == i for i in range(2)]
        written = [
            c if b else write(c, k, val, on)
            for c, b, on in zip(caches.caches, before, enabled, strict=True)
        ]
        branches = [
            functools.partial(self._attend_written, cache=c, allowed=a, fill=f, before=b)
            for c, a, f, b in zip(written, allowed, fill, before, strict=True)
        ]
        out = jax.lax.switch(caches.kind, branches, q, k, val)
        written = [
            write(c, k, val, on) if b else c
            for c, b, on in zip(written, before, enabled, strict=True)
        ]
        return out, caches._replace(caches=tuple(written))

    def _attend_written(self, q, k, val, cache: LayerCache, allowed, fill, before: bool):
        """Attention over the slots of `cache` written so far, these tokens' included; or,
        `before` they are written (a ring given several tokens), over those before them
        followed by `k`, `val` themselves."""
        tokens, slots = k.shape[2], cache.keys.shape[3]
        if before:
            end = jnp.minimum(cache.index, slots)
            return self._attend_filled(q, cache, end, allowed, fill, (k, val))
        end = jnp.minimum(cache.index + tokens, slots)
        return self._attend_filled(q, cache, end, allowed, fill)

    def _attend(self, q, k, val, allowed, fill):
        """Softmax attention of `q [B, K, G, T, D]` over `k`, `val` `[B, K, S, D]`; with
        sinks, each head's sink logit is one more column of the softmax, then dropped."""
        high = v.compute_dtype(self.dtype)
        scores = jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=high)
        scores = scores * jnp.asarray(self.scale, high)
        if self.softcap is not None:
            scores = self.softcap * jnp.tanh(scores / self.softcap)
        scores = jnp.where(allowed, scores, fill)
        if self.sinks is None:
            probs = jax.nn.softmax(scores, axis=-1)
        else:
            # Query head n = k * groups + g, as the queries are grouped.
            sinks = rearrange(self.sinks[...].astype(high), "(k g) -> k g 1 1", k=q.shape[1])
            sinks = jnp.broadcast_to(sinks, (*scores.shape[:-1], 1))
            probs = jax.nn.softmax(jnp.concatenate([scores, sinks], axis=-1), axis=-1)[..., :-1]
        return jnp.einsum("bkgts,bksd->bkgtd", probs.astype(self.dtype), val.astype(self.dtype))

    def _attend_filled(self, q, cache: LayerCache, end, allowed, fill, new=None):
        """Attention over the cache's first slots only: those up to `end` (traced), rounded
        up to a whole bucket of `cache_buckets` slots; then, for a ring, over the block's
        own keys and values `new` (the last `T` columns of `allowed` and `fill`). The slots
        left out are later than every query or not written yet, so their weights are
        exactly 0 and the result is the whole cache's."""
        _, b, kv, slots, d = cache.keys.shape
        dv = cache.values.shape[-1]
        buckets = cache_buckets(slots)

        def over(n):
            def attend(q, all_k, all_v, layer, allowed, fill, new):
                at = (layer, 0, 0, 0, 0)
                k = jax.lax.dynamic_slice(all_k, at, (1, b, kv, n, d))[0]
                val = jax.lax.dynamic_slice(all_v, at, (1, b, kv, n, dv))[0]
                seen, scores = allowed[..., :n], fill[:, :n]
                if new is not None:
                    k = jnp.concatenate([k, new[0].astype(k.dtype)], axis=2)
                    val = jnp.concatenate([val, new[1].astype(val.dtype)], axis=2)
                    seen = jnp.concatenate([seen, allowed[..., slots:]], axis=-1)
                    scores = jnp.concatenate([scores, fill[:, slots:]], axis=-1)
                return self._attend(q, k, val, seen, scores)

            return attend

        args = (q, cache.keys, cache.values, cache.layer, allowed, fill, new)
        if len(buckets) == 1:
            return over(slots)(*args)
        which = jnp.searchsorted(jnp.asarray(buckets), end, side="left")
        which = jnp.clip(which, 0, len(buckets) - 1)
        return jax.lax.switch(which, [over(n) for n in buckets], *args)


def cache_buckets(slots: int) -> tuple[int, ...]:
    """The prefix lengths a cached attention reads, ascending, the last `slots`: a decode step
    attends over the shortest that holds every slot written so far, so that its cost grows
    with the tokens present rather than with the cache's size. At most `_MAX_BUCKETS` (each
    is a branch of the compiled step), each a multiple of `_BUCKET` slots."""
    width = max(_BUCKET, -(-slots // _MAX_BUCKETS))
    width = -(-width // _BUCKET) * _BUCKET
    return (*range(width, slots, width), slots)


def activation(name: str):
    """The gate activation `config.hidden_act` names."""
    if name == "gelu_pytorch_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return jax.nn.silu


class MLP(nnx.Module):
    r"""Gated feed-forward block: $W_d\,(\phi(x W_g) \odot x W_u)$, with $\phi$ = SiLU
    (SwiGLU) or the tanh GELU (GeGLU, Gemma) as `config.hidden_act` says, `width` wide
    (None: `config.intermediate_size`)."""

    def __init__(self, config: DecoderConfig, *, width: int | None = None, rngs: nnx.Rngs):
        c = config
        h, f = c.hidden_size, width or c.intermediate_size
        bias = c.mlp_bias
        self.gate_proj = Dense(h, f, ("embed", "mlp"), c, use_bias=bias, rngs=rngs)
        self.up_proj = Dense(h, f, ("embed", "mlp"), c, use_bias=bias, rngs=rngs)
        self.down_proj = Dense(f, h, ("mlp", "embed"), c, use_bias=bias, rngs=rngs)
        self.act = c.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))
