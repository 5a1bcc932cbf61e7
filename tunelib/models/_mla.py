r"""Multi-head latent attention (MLA, DeepSeek-V2 and V3), with its compressed KV cache.

Keys and values of $N$ heads come from one $r$-wide latent per token,
$c = \mathrm{RMSNorm}(x W_{DKV})$, and one rotated key $k^R$ shared by every head:

$$ k_n = [c\, W_{UK,n};\ k^R], \qquad v_n = c\, W_{UV,n}, \qquad
q_n = [q^C_n;\ \mathrm{RoPE}(q^R_n)] $$

The absorbed form computes the same scores from the latent itself,
$q_n \cdot k_n = (W_{UK,n}\, q^C_n) \cdot c + q^R_n \cdot k^R$, and the output of head $n$
as $(\sum_s p_s c_s) W_{UV,n}$: a KV cache then holds $c$ and $k^R$ only, $r + D_R$ numbers
per token and layer for all heads (`DecoderConfig.layer_cache_widths`).
"""

import math

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx

from tunelib.models._config import DecoderConfig
from tunelib.models._layers import Attention, Dense, RMSNorm
from tunelib.models._rope import apply_rope
from tunelib.models._windowed import LayerCache

# transformers' DeepSeek-V3 builds `q_a_layernorm` and `kv_a_layernorm` with its RMSNorm's
# default epsilon, not `rms_norm_eps`.
_LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(config: DecoderConfig) -> float:
    r"""$(D_C + D_R)^{-1/2}$, times $m(s, a)^2$ under YaRN with `mscale_all_dim` $a$
    ($m(s, a) = 0.1\, a \ln s + 1$ for a factor $s > 1$, else 1), as transformers'
    `yarn_apply_mscale`."""
    scale = (config.qk_nope_head_dim + config.head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    all_dim = scaling.get("mscale_all_dim")
    if all_dim:
        factor = float(scaling["factor"])
        m = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


class LatentAttention(Attention):
    """DeepSeek-V3's multi-head latent attention, weights named as transformers names them:
    `q_proj` (or `q_a_proj`, `q_a_layernorm`, `q_b_proj` with `config.q_lora_rank`),
    `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj` and `o_proj`.

    Without a cache it computes every head's keys and values (the form transformers
    computes); with one it runs in the absorbed form over the cached latents, as
    multi-query attention with one key head of width $r + D_R$ whose values are the
    latent's first $r$ channels. `config.rope_interleave` rotates the channel pairs
    $(2i, 2i + 1)$: they are de-interleaved first, as transformers does.
    """

    def __init__(self, config: DecoderConfig, index: int = 0, *, rngs: nnx.Rngs):
        c = config
        n, h = c.num_attention_heads, c.hidden_size
        self.num_heads, self.rank = n, c.kv_lora_rank
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.head_dim, c.v_head_dim
        self.interleave = c.rope_interleave
        self.dtype = c.compute_dtype
        self.compressed_q = c.q_lora_rank is not None
        bias = c.attention_bias
        q_width = n * (self.nope + self.rope)
        if not self.compressed_q:
            self.q_proj = Dense(h, q_width, ("embed", "q_heads"), c, use_bias=False, rngs=rngs)
        else:
            q = c.q_lora_rank
            self.q_a_proj = Dense(h, q, ("embed", None), c, use_bias=bias, rngs=rngs)
            self.q_a_layernorm = RMSNorm(q, None, c, eps=_LATENT_NORM_EPS, rngs=rngs)
            self.q_b_proj = Dense(q, q_width, (None, "q_heads"), c, use_bias=False, rngs=rngs)
        self.kv_a_proj_with_mqa = Dense(
            h, self.rank + self.rope, ("embed", None), c, use_bias=bias, rngs=rngs
        )
        self.kv_a_layernorm = RMSNorm(self.rank, None, c, eps=_LATENT_NORM_EPS, rngs=rngs)
        self.kv_b_proj = Dense(
            self.rank, n * (self.nope + self.v_dim), (None, "q_heads"), c, use_bias=False, rngs=rngs
        )
        self.o_proj = Dense(n * self.v_dim, h, ("q_heads", "embed"), c, use_bias=bias, rngs=rngs)
        self.scale = mla_softmax_scale(c)
        self.softcap, self.sinks = None, None

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        allowed: jax.Array,
        fill: jax.Array,
        cache: LayerCache | None = None,
        shared: None = None,
    ) -> tuple[jax.Array, LayerCache | None, tuple[jax.Array, jax.Array]]:
        """Attention of `x [B, T, H]` (see `Attention`); a cache holds `[L, B, 1, S, r + D_R]`
        latents and rotated keys, and `[L, B, 1, S, 0]` values."""
        if self.compressed_q:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = rearrange(q, "b t (n d) -> b t n d", n=self.num_heads)
        q_nope, q_rot = q[..., : self.nope], self._rotate(q[..., self.nope :], cos, sin)
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., : self.rank])
        k_rot = self._rotate(compressed[..., None, self.rank :], cos, sin)  # [B, T, 1, D_R]
        if cache is None:
            return self._expanded(q_nope, q_rot, latent, k_rot, allowed, fill)
        return self._absorbed(q_nope, q_rot, latent, k_rot, cache, allowed, fill)

    def _expanded(self, q_nope, q_rot, latent, k_rot, allowed, fill):
        """Every head's keys and values from the latents, as transformers computes them."""
        kv = rearrange(self.kv_b_proj(latent), "b t (n d) -> b n t d", n=self.num_heads)
        k_nope, val = kv[..., : self.nope], kv[..., self.nope :]
        k_rot = jnp.broadcast_to(
            rearrange(k_rot, "b t 1 d -> b 1 t d"), (*k_nope.shape[:3], self.rope)
        )
        k = jnp.concatenate([k_nope, k_rot.astype(k_nope.dtype)], axis=-1)
        q = rearrange(jnp.concatenate([q_nope, q_rot], axis=-1), "b t n d -> b n 1 t d")
        out = self._attend(q, k, val, allowed, fill)
        return self.o_proj(rearrange(out, "b n 1 t d -> b t (n d)")), None, (k, val)

    def _absorbed(self, q_nope, q_rot, latent, k_rot, cache, allowed, fill):
        """The absorbed form over the cache: $W_{UK}$ folded into the queries, which attend
        over the cached latents and rotated keys as one key head; $W_{UV}$ after."""
        w = rearrange(
            self.kv_b_proj.kernel[...].astype(self.dtype), "r (n d) -> r n d", n=self.num_heads
        )
        q_latent = jnp.einsum("btnd,rnd->btnr", q_nope, w[..., : self.nope])
        q = rearrange(jnp.concatenate([q_latent, q_rot], axis=-1), "b t n d -> b 1 n t d")
        k = rearrange(
            jnp.concatenate([latent, k_rot[:, :, 0].astype(latent.dtype)], axis=-1),
            "b t d -> b 1 t d",
        )
        val = jnp.zeros((*k.shape[:3], 0), k.dtype)
        out, cache, (k, val) = self._attend_cached(q, k, val, cache, allowed, fill)
        out = jnp.einsum("bntr,rnd->btnd", out[:, 0], w[..., self.nope :])  # W_UV after
        return self.o_proj(rearrange(out, "b t n d -> b t (n d)")), cache, (k, val)

    def _rotate(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """RoPE on `x [B, T, heads, D_R]`; interleaved pairs are de-interleaved first."""
        if self.interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rope(x, cos, sin)

    def _attend(self, q, k, val, allowed, fill):
        """`Attention._attend`; cached latents (no value channels) are their own values."""
        if val.shape[-1] == 0:
            val = k[..., : self.rank]
        return super()._attend(q, k, val, allowed, fill)
