"""One decoder layer: attention and an MLP (dense or a mixture of experts), pre-norm."""

import jax
from flax import nnx

from tunelib.models._config import DecoderConfig
from tunelib.models._layers import MLP, Attention, LayerCache, RMSNorm
from tunelib.models._moe import MoE


class DecoderLayer(nnx.Module):
    """Pre-norm residual layer: attention, then the MLP (dense, or a mixture of experts when
    `moe`), each on its own RMSNorm."""

    def __init__(self, config: DecoderConfig, *, moe: bool = False, rngs: nnx.Rngs):
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, "embed", config, rngs=rngs)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(h, "embed", config, rngs=rngs)
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
        x = x + attended
        if not self.moe:
            return x + self.mlp(self.post_attention_layernorm(x)), cache, None
        mixed, router_logits = self.mlp(self.post_attention_layernorm(x))
        return x + mixed, cache, router_logits
