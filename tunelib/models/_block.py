"""One decoder layer: attention and an MLP (dense or a mixture of experts), pre-norm."""

import jax
from flax import nnx

from tunelib.models._config import DecoderConfig
from tunelib.models._layers import MLP, Attention, LayerCache, RMSNorm
from tunelib.models._moe import MoE


class DecoderLayer(nnx.Module):
    """Pre-norm residual layer: attention, then the MLP (dense, or a mixture of experts when
    `moe`), each on its own RMSNorm.

    With `config.sandwich_norms` (Gemma 2 and 3) the attention and MLP outputs are normalised
    as well before their residual additions: `post_attention_layernorm` then normalises the
    attention's output, and `pre_feedforward_layernorm` / `post_feedforward_layernorm` the
    MLP's input and output. Without, `post_attention_layernorm` is the MLP's input norm, as
    Hugging Face names it for Llama.
    """

    def __init__(self, config: DecoderConfig, *, moe: bool = False, rngs: nnx.Rngs):
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, "embed", config, rngs=rngs)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(h, "embed", config, rngs=rngs)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, "embed", config, rngs=rngs)
            self.post_feedforward_layernorm = RMSNorm(h, "embed", config, rngs=rngs)
        self.mlp = MoE(config, rngs=rngs) if moe else MLP(config, rngs=rngs)
        self.moe = moe

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        allowed: jax.Array,
        fill: jax.Array,
        cache: LayerCache | None = None,
    ) -> tuple[jax.Array, LayerCache | None, jax.Array | None]:
        """The layer's output, its updated cache and (for a mixture of experts) its router
        logits `[B, T, E]`, else None."""
        attended, cache = self.self_attn(self.input_layernorm(x), cos, sin, allowed, fill, cache)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attended)
            mixed = self.mlp(self.pre_feedforward_layernorm(x))
        else:
            x = x + attended
            mixed = self.mlp(self.post_attention_layernorm(x))
        mixed, router_logits = mixed if self.moe else (mixed, None)
        if self.sandwich:
            mixed = self.post_feedforward_layernorm(mixed)
        return x + mixed, cache, router_logits
