"""The Gated DeltaNet token mixer of Qwen3.5's `"linear_attention"` layers."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange, repeat
from flax import nnx

from tunelib.models._config import DecoderConfig
from tunelib.models._delta_net import (
    causal_conv1d,
    chunked_gated_delta_rule,
    gated_rms_norm,
    recurrent_gated_delta_rule,
)
from tunelib.models._layers import Dense, kernel_init, param


class DeltaNetState(NamedTuple):
    """A Gated DeltaNet layer's state between calls: the convolution's last `K_c - 1` inputs
    `conv` `[B, K_c - 1, C]` and the delta rule's state `recurrent` `[B, h_v, d_k, d_v]`
    (float32 at least), with `where` `[B, T]`, which of the new tokens are real."""

    conv: jax.Array
    recurrent: jax.Array
    where: jax.Array


class _Weight(nnx.Module):
    """A module holding one parameter under `name` (Hugging Face's `conv1d.weight`,
    `norm.weight`)."""

    def __init__(self, name: str, value: nnx.Param):
        setattr(self, name, value)


def _a_log_init(key, shape, dtype):
    """`log A` with `A` uniform in [1, 16] (Hugging Face draws it from [0.01, 16])."""
    return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


class GatedDeltaNet(nnx.Module):
    r"""A Gated DeltaNet layer (Qwen3.5's `linear_attn`), in place of attention.

    For input $x$ (zero at padded positions):
    $[q; k; v] = \mathrm{silu}(\mathrm{conv}(x W_{qkv}))$ (`causal_conv1d`, $K_c$ taps),
    split into $h_k$ query and key heads of width $d_k$ and $h_v$ value heads of width
    $d_v$; $q$ and $k$ are L2-normalised per head ($\epsilon = 10^{-6}$ under the root) and
    $q$ scaled by $d_k^{-1/2}$; value head $j$ reads query/key head
    $\lfloor j h_k / h_v \rfloor$. Per value head, $\beta_t = \sigma(x_t W_b)$ and
    $g_t = -e^{a} \,\mathrm{softplus}(x_t W_a + b_{dt})$ ($a$ = `A_log`, $b_{dt}$ =
    `dt_bias`), zero at padded positions so the state passes them unchanged; the gated delta
    rule (`chunked_gated_delta_rule`) gives $o$; the output is
    $W_o\, \mathrm{GatedRMSNorm}(o, x W_z)$ per head (`gated_rms_norm`). Left-padded rows
    then give their real tokens' outputs exactly as unpadded rows do (Hugging Face's
    `apply_mask_to_padding_states` zeroes the same inputs).

    The weights keep Hugging Face's names and layouts: `in_proj_qkv`, `in_proj_z`,
    `in_proj_b`, `in_proj_a`, `out_proj` kernels (stored `[in, out]`), `conv1d/weight`
    `[C, 1, K_c]` (PyTorch's depthwise `Conv1d`), `dt_bias` and `A_log` `[h_v]`, `norm/scale`
    `[d_v]` (Hugging Face's `norm.weight`).

    References:
      Yang, Kautz and Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule",
      2024, https://arxiv.org/abs/2412.06464.
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        c = config
        h = c.hidden_size
        self.key_heads, self.value_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.key_dim, self.value_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.chunk_size, self.eps = c.linear_chunk_size, c.rms_norm_eps
        self.dtype = c.compute_dtype
        keys = self.key_heads * self.key_dim
        values = self.value_heads * self.value_dim
        channels = 2 * keys + values
        self.in_proj_qkv = Dense(h, channels, ("embed", "linear_qkv"), c, use_bias=False, rngs=rngs)
        self.in_proj_z = Dense(h, values, ("embed", "linear_v"), c, use_bias=False, rngs=rngs)
        self.in_proj_b = Dense(
            h, self.value_heads, ("embed", "linear_heads"), c, use_bias=False, rngs=rngs
        )
        self.in_proj_a = Dense(
            h, self.value_heads, ("embed", "linear_heads"), c, use_bias=False, rngs=rngs
        )
        conv = (channels, 1, c.linear_conv_kernel_dim)
        names = ("linear_qkv", None, None)
        self.conv1d = _Weight("weight", param(rngs, kernel_init(c), conv, names, c.storage_dtype))
        ones = jax.nn.initializers.ones
        self.dt_bias = param(rngs, ones, (self.value_heads,), (None,), c.storage_dtype)
        self.A_log = param(rngs, _a_log_init, (self.value_heads,), (None,), c.storage_dtype)
        self.norm = _Weight("scale", param(rngs, ones, (self.value_dim,), (None,), c.storage_dtype))
        self.out_proj = Dense(values, h, ("linear_v", "embed"), c, use_bias=False, rngs=rngs)

    def __call__(
        self, x: jax.Array, where: jax.Array, state: DeltaNetState | None = None
    ) -> tuple[jax.Array, DeltaNetState | None]:
        """The layer's output for `x [B, T, H]` with `where [B, T]` (True = a real token),
        continuing from `state` (None: from zeros, and no state is returned). A single token
        runs the recurrent form, several the chunked one."""
        x = jnp.where(where[..., None], x, 0).astype(self.dtype)
        conv_state = None if state is None else state.conv
        mixed, conv_state = causal_conv1d(
            self.in_proj_qkv(x), self.conv1d.weight[...][:, 0].astype(self.dtype), conv_state
        )
        mixed = jax.nn.silu(mixed)
        keys = self.key_heads * self.key_dim
        q, k, values = jnp.split(mixed, np.cumsum([keys, keys]), axis=-1)
        group = self.value_heads // self.key_heads

        def key_heads(y):  # each serves `group` consecutive value heads
            y = rearrange(y, "b t (h d) -> b t h d", d=self.key_dim)
            return repeat(y, "b t h d -> b t (h g) d", g=group).astype(high)

        high = jnp.promote_types(self.dtype, jnp.float32)
        q, k = (_l2_normalised(key_heads(y)) for y in (q, k))
        q = q * self.key_dim**-0.5
        values = rearrange(values, "b t (h d) -> b t h d", d=self.value_dim)
        beta = jax.nn.sigmoid(self.in_proj_b(x).astype(high))
        a = self.in_proj_a(x).astype(high) + self.dt_bias[...].astype(high)
        g = -jnp.exp(self.A_log[...].astype(high)) * jax.nn.softplus(a)
        g = jnp.where(where[..., None], g, 0.0)
        recurrent = None if state is None else state.recurrent
        if x.shape[1] == 1 and state is not None:
            out, recurrent = recurrent_gated_delta_rule(q, k, values, g, beta, recurrent)
        else:
            out, recurrent = chunked_gated_delta_rule(
                q, k, values, g, beta, recurrent, chunk_size=self.chunk_size
            )
        z = rearrange(self.in_proj_z(x), "b t (h d) -> b t h d", d=self.value_dim)
        normed = gated_rms_norm(out.astype(self.dtype), z, self.norm.scale[...], eps=self.eps)
        out = self.out_proj(rearrange(normed, "b t h d -> b t (h d)"))
        if state is None:
            return out, None
        return out, DeltaNetState(conv_state.astype(state.conv.dtype), recurrent, state.where)


def _l2_normalised(x: jax.Array) -> jax.Array:
    """`x / sqrt(sum(x^2) + 1e-6)` over the last axis (the FLA kernels' `l2norm`)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)
