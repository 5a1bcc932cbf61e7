"""One decoder layer: attention and an MLP (dense, a mixture of experts, or both), pre-norm."""

import jax
import jax.numpy as jnp
from flax import nnx

from tunelib import _validation as v
from tunelib.models._config import DecoderConfig
from tunelib.models._deepseek_moe import DeepSeekMoE
from tunelib.models._gated_delta_net import DeltaNetState, GatedDeltaNet
from tunelib.models._layers import MLP, Attention, Dense, RMSNorm, activation, param
from tunelib.models._mla import LatentAttention
from tunelib.models._moe import FusedExperts, MoE, Router
from tunelib.models._windowed import KindCaches, LayerCache


class DecoderLayer(nnx.Module):
    r"""Pre-norm residual layer `index` of `config`: attention, then the MLP (dense, or a
    mixture of experts where `config.moe_layers` says), each on its own RMSNorm.

    With `config.sandwich_norms` (Gemma 2, 3, 4) the attention and MLP outputs are normalised
    as well before their residual additions: `post_attention_layernorm` then normalises the
    attention's output, and `pre_feedforward_layernorm` / `post_feedforward_layernorm` the
    MLP's input and output. Without, `post_attention_layernorm` is the MLP's input norm, as
    Hugging Face names it for Llama.

    DeepSeek-V3's layers attend by multi-head latent attention (`config.kv_lora_rank`) and
    their mixtures of experts are `DeepSeekMoE` (`config.scoring_func="sigmoid"`).

    Gemma 4 adds, where its config asks: a mixture of experts beside the dense MLP
    (`config.parallel_moe`): with $u$ the residual after attention,
    $m = N_1(\mathrm{MLP}(N_{pre}(u))) + N_2(\mathrm{MoE}(N_{pre,2}(u)))$, routed on $u$
    itself, and $u + N_{post}(m)$; the per-layer input (`config.hidden_size_per_layer_input`)
    added at the end; and the output multiplied by `layer_scalar`.

    A `"linear_attention"` layer (Qwen3.5, `config.linear_layers`) has a Gated DeltaNet
    (`linear_attn`, `tunelib.models.GatedDeltaNet`) where the others have attention.
    """

    def __init__(self, config: DecoderConfig, index: int = 0, *, rngs: nnx.Rngs):
        c = config
        h = c.hidden_size
        self.input_layernorm = RMSNorm(h, "embed", c, rngs=rngs)
        self.linear = c.linear_layers[index]
        if self.linear:
            self.linear_attn = GatedDeltaNet(c, rngs=rngs)
        else:
            attention = Attention if c.kv_lora_rank is None else LatentAttention
            self.self_attn = attention(c, index, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(h, "embed", c, rngs=rngs)
        self.sandwich = c.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, "embed", c, rngs=rngs)
            self.post_feedforward_layernorm = RMSNorm(h, "embed", c, rngs=rngs)
        self.moe = c.moe_layers[index] and not c.parallel_moe
        shares_kv = c.kv_sources[index] != index
        width = c.intermediate_size * (2 if c.use_double_wide_mlp and shares_kv else 1)
        moe = DeepSeekMoE if c.scoring_func == "sigmoid" else MoE
        self.mlp = moe(c, rngs=rngs) if self.moe else MLP(c, width=width, rngs=rngs)
        self.parallel_moe = c.parallel_moe and c.moe_layers[index]
        if self.parallel_moe:
            self.router = Router(c, rngs=rngs)
            self.experts = FusedExperts(c, rngs=rngs)
            self.post_feedforward_layernorm_1 = RMSNorm(h, "embed", c, rngs=rngs)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, "embed", c, rngs=rngs)
            self.post_feedforward_layernorm_2 = RMSNorm(h, "embed", c, rngs=rngs)
        p = c.hidden_size_per_layer_input
        if p:
            self.act = c.hidden_act
            self.per_layer_input_gate = Dense(
                h, p, ("embed", "per_layer"), c, use_bias=False, rngs=rngs
            )
            self.per_layer_projection = Dense(
                p, h, ("per_layer", "embed"), c, use_bias=False, rngs=rngs
            )
            self.post_per_layer_input_norm = RMSNorm(h, "embed", c, rngs=rngs)
        ones = jax.nn.initializers.ones
        self.layer_scalar = (
            param(rngs, ones, (1,), (None,), c.storage_dtype) if c.layer_scalars else None
        )

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        allowed: jax.Array | tuple[jax.Array, jax.Array],
        fill: jax.Array | tuple[jax.Array, jax.Array],
        cache: LayerCache | KindCaches | DeltaNetState | None = None,
        shared: tuple[jax.Array, jax.Array] | None = None,
        per_layer_input: jax.Array | None = None,
        routing: jax.Array | None = None,
    ) -> tuple[
        jax.Array,
        LayerCache | KindCaches | DeltaNetState | None,
        tuple[jax.Array, jax.Array] | None,
        tuple[jax.Array, jax.Array] | None,
    ]:
        """The layer's output, its updated cache, (for a mixture of experts) its router logits
        `[B, T, E]` and the `[B, T, k]` experts each token went to, else None, and the keys
        and values it attended over (see `Attention`). `routing` `[B, T, k]` replays recorded
        experts in a mixture-of-experts layer (`tunelib.models.route`'s `experts`); a dense
        layer ignores it. A Gated DeltaNet layer attends over no keys and values: None."""
        if self.linear:
            if cache is None:
                # A token is real where it sees itself: the diagonal of the uncached mask.
                where = jnp.diagonal(allowed[:, 0, 0], axis1=-2, axis2=-1)
            else:
                where = cache.where
            attended, cache = self.linear_attn(self.input_layernorm(x), where, cache)
            kv = None
        else:
            attended, cache, kv = self.self_attn(
                self.input_layernorm(x), cos, sin, allowed, fill, cache, shared
            )
        routed_to = None
        mlp = (lambda h: self.mlp(h, routing, return_routing=True)) if self.moe else self.mlp
        if self.sandwich:
            x = x + self.post_attention_layernorm(attended)
            mixed = mlp(self.pre_feedforward_layernorm(x))
        else:
            x = x + attended
            mixed = mlp(self.post_attention_layernorm(x))
        if self.moe:
            mixed, *routed_to = mixed
        if self.parallel_moe:
            flat = x.reshape(-1, x.shape[-1])
            replayed = None if routing is None else routing.reshape(flat.shape[0], -1)
            weights, chosen, logits = self.router(flat, replayed)
            routed = self.experts(self.pre_feedforward_layernorm_2(flat), weights, chosen)
            routed = self.post_feedforward_layernorm_2(routed.reshape(x.shape))
            mixed = self.post_feedforward_layernorm_1(mixed) + routed
            high = v.compute_dtype(logits.dtype)  # float32, float64 for a float64 model
            lead = x.shape[:-1]
            routed_to = (logits.astype(high).reshape(*lead, -1), chosen.reshape(*lead, -1))
        if self.sandwich:
            mixed = self.post_feedforward_layernorm(mixed)
        x = x + mixed
        if per_layer_input is not None:
            gated = activation(self.act)(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        if self.layer_scalar is not None:
            # A Hugging Face buffer, not a trained weight: no gradient reaches it.
            x = x * jax.lax.stop_gradient(self.layer_scalar[...]).astype(x.dtype)
        return x, cache, None if routed_to is None else tuple(routed_to), kv
