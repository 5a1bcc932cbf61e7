"""The mixture-of-experts MLP: softmax top-k routing and dropless experts (Qwen3-MoE, gpt-oss's
biased experts, Gemma 4's router and fused experts, Qwen3.5-MoE's gated shared expert)."""

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from tunelib import _validation as v
from tunelib.models._config import DecoderConfig
from tunelib.models._grouped_matmul import GroupedImplementation, grouped_matmul
from tunelib.models._layers import MLP, Dense, RMSNorm, activation, kernel_init, param


def route(
    router_logits: Float[ArrayLike, "*N E"],
    *,
    top_k: int,
    norm_topk_prob: bool = False,
    experts: Int[ArrayLike, "*N k"] | None = None,
) -> tuple[Float[Array, "*N k"], Int[Array, "*N k"]]:
    r"""Softmax top-k routing: each token's `top_k` experts and their weights.

    $p = \mathrm{softmax}(z)$ over the $E$ experts (in at least float32); the chosen experts
    $\mathcal{K}$ are the $k$ largest $p_e$, in decreasing order, and their weights are those
    $p_e$, divided by their sum when `norm_topk_prob` (Qwen3-MoE's flag; Mixtral always
    renormalises):

    $$ w_e = p_e \quad\text{or}\quad w_e = \frac{p_e}{\sum_{j \in \mathcal{K}} p_j}
    = \frac{e^{z_e}}{\sum_{j \in \mathcal{K}} e^{z_j}}, \qquad e \in \mathcal{K}. $$

    Routing replay (R3): with `experts` given, $\mathcal{K}$ is read from it instead of
    chosen by top-k, and the weights are the same formula over that set, from these logits
    $z$: they stay functions of $z$ (and differentiable), only the choice is fixed. With
    `norm_topk_prob` this is the R3 paper's replayed gate, a softmax of the logits masked to
    the recorded experts; without, it is the family's own unnormalised top-k probability at
    the recorded experts, as Megatron-LM's router replay gathers the scores of the replayed
    indices. Ids outside `[0, E)` give NaN weights (a concrete out-of-range id is caught
    earlier, by `tunelib.models.Decoder`).

    Args:
      router_logits: `[..., E]` router logits $z$ (`tunelib.models.Decoder` returns them
        with `return_router_logits=True`).
      top_k: $k$, static, in `[1, E]`.
      norm_topk_prob: renormalise the chosen weights to sum to 1.
      experts: `[..., k]` integer expert ids to route to (a recorded routing, see
        `tunelib.models.Decoder`'s `routing`); None (the default) chooses by top-k.

    Returns:
      `(weights, experts)`: `[..., k]` float weights (float32, float64 for float64 logits)
      and `[..., k]` int32 expert indices.

    References:
      Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
      Routers" (R3, routing replay), 2025, https://arxiv.org/abs/2510.11370.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.models import route
      >>> weights, experts = route(jnp.log(jnp.array([0.1, 0.6, 0.3])), top_k=2)
      >>> print(experts, weights.round(3))
      [1 2] [0.6 0.3]
      >>> print(route(jnp.log(jnp.array([0.1, 0.6, 0.3])), top_k=2, norm_topk_prob=True)[0])
      [0.6666667 0.3333333]

      Replayed: expert 0 is kept although expert 2 now scores higher.

      >>> weights, experts = route(jnp.log(jnp.array([0.1, 0.6, 0.3])), top_k=2,
      ...                          norm_topk_prob=True, experts=jnp.array([1, 0]))
      >>> print(experts, weights.round(4))
      [1 0] [0.8571 0.1429]
    """
    logits = v.float_array(router_logits, "router_logits")
    num_experts = logits.shape[-1] if logits.ndim else 0
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"top_k must be an int in [1, {num_experts}] (the experts in router_logits "
            f"{logits.shape}), got {top_k!r}."
        )
    probs = jax.nn.softmax(logits.astype(v.compute_dtype(logits.dtype)), axis=-1)
    if experts is None:
        weights, chosen = jax.lax.top_k(probs, top_k)
    else:
        chosen = v.int_array(experts, "experts")
        v.check_shape(chosen, "experts", (*logits.shape[:-1], top_k), f"top_k={top_k}")
        inside = (chosen >= 0) & (chosen < num_experts)
        weights = jnp.take_along_axis(probs, jnp.where(inside, chosen, 0), axis=-1)
        weights = jnp.where(inside, weights, jnp.nan)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, chosen.astype(jnp.int32)


class ExpertDense(nnx.Module):
    """`E` kernels `[E, in, out]`: expert `e`'s rows times `kernel[e]` (a grouped product),
    plus `bias[e]` `[E, out]` with `use_bias`."""

    def __init__(
        self,
        features_in: int,
        features_out: int,
        names: tuple[str, str],
        config: DecoderConfig,
        *,
        use_bias: bool = False,
        rngs: nnx.Rngs,
    ):
        self.dtype = config.compute_dtype
        e = config.num_experts
        shape = (e, features_in, features_out)
        self.kernel = param(
            rngs, kernel_init(config), shape, ("experts", *names), config.storage_dtype
        )
        self.bias = (
            param(
                rngs,
                jax.nn.initializers.zeros,
                (e, features_out),
                ("experts", names[1]),
                config.storage_dtype,
            )
            if use_bias
            else None
        )

    def __call__(self, rows: jax.Array, group_sizes: jax.Array, implementation) -> jax.Array:
        kernel = self.kernel[...].astype(self.dtype)
        out = grouped_matmul(
            rows.astype(self.dtype), kernel, group_sizes, implementation=implementation
        )
        if self.bias is None:
            return out
        # Row m belongs to expert g(m) (runs of `group_sizes` rows): it gets bias[g(m)].
        bias = jnp.repeat(
            self.bias[...].astype(self.dtype), group_sizes, axis=0, total_repeat_length=len(rows)
        )
        return out + bias


class MoE(nnx.Module):
    r"""A sparse mixture of SwiGLU experts with softmax top-k routing, computed dropless.

    For a token $x$ with router logits $z = x W_r$ and chosen experts $\mathcal{K}$, weights
    $w_e$ (`tunelib.models.route`):

    $$ y = \sum_{e \in \mathcal{K}} w_e \, W^{(e)}_d \big(\mathrm{silu}(x W^{(e)}_g)
    \odot x W^{(e)}_u\big) $$

    With `config.biased_experts` (gpt-oss) the router is $z = x W_r + b_r$, the weights a
    softmax over the $k$ chosen logits, and each expert is a clamped SwiGLU with biases
    (`ClampedExperts`), stored as `router` and `experts/{gate_up_proj, down_proj}`.
    With `config.shared_expert_intermediate_size` $F_s > 0$ (Qwen3.5-MoE) a shared SwiGLU
    expert
    (`shared_expert`, $F_s$ wide) runs on every token and
    $y \leftarrow y + \sigma(x w_{sg})\, \mathrm{SwiGLU}_s(x)$ (`shared_expert_gate`).

    Every token reaches all of its $k$ experts (no capacity, nothing dropped): the $N k$
    (token, expert) pairs are sorted by expert and each expert's run of rows goes through its
    weights in one grouped product (`tunelib.models.grouped_matmul`), with no loop over
    experts. Weights are stored stacked, `experts/gate_proj/kernel` `[E, H, F]` and so on, so
    the "experts" axis can be sharded (expert parallelism). As in Qwen3-MoE, the router
    weights are cast to the compute dtype before they scale the experts' outputs.

    References:
      Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated
      Mixture-of-Experts Layer", 2017, https://arxiv.org/abs/1701.06538.
      Gale et al., "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts", 2022,
      https://arxiv.org/abs/2211.15841.
      Yang et al., "Qwen3 Technical Report", 2025, https://arxiv.org/abs/2505.09388.
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        implementation: GroupedImplementation = "auto",
        rngs: nnx.Rngs,
    ):
        c = config
        h, f = c.hidden_size, c.moe_intermediate_size
        self.top_k, self.norm_topk_prob = c.num_experts_per_tok, c.norm_topk_prob
        self.num_experts, self.dtype = c.num_experts, c.compute_dtype
        self.implementation, self.act = implementation, c.hidden_act
        self.shared_expert = self.shared_expert_gate = None  # Qwen3.5-MoE's, set below
        if c.biased_experts:
            self.router = Dense(h, c.num_experts, ("embed", "router"), c, use_bias=True, rngs=rngs)
            self.experts = ClampedExperts(c, implementation=implementation, rngs=rngs)
            return
        self.gate = Dense(h, c.num_experts, ("embed", "router"), c, use_bias=False, rngs=rngs)
        self.experts = nnx.Dict(
            gate_proj=ExpertDense(h, f, ("embed", "mlp"), c, rngs=rngs),
            up_proj=ExpertDense(h, f, ("embed", "mlp"), c, rngs=rngs),
            down_proj=ExpertDense(f, h, ("mlp", "embed"), c, rngs=rngs),
        )
        shared = c.shared_expert_intermediate_size
        if shared:
            self.shared_expert = nnx.data(MLP(c, width=shared, rngs=rngs))
            names = ("embed", "shared_gate")
            self.shared_expert_gate = nnx.data(Dense(h, 1, names, c, use_bias=False, rngs=rngs))

    def __call__(
        self, x: jax.Array, routing: jax.Array | None = None, *, return_routing: bool = False
    ) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, jax.Array]:
        """The layer's output for `x [B, T, H]` and its router logits `[B, T, E]` (float32,
        float64 for a float64 model); with `return_routing`, also the `[B, T, k]` int32
        experts each token went to. `routing` `[B, T, k]` replays recorded experts (`route`'s
        `experts`): the weights still come from this layer's router logits."""
        *lead, h = x.shape
        flat = x.reshape(-1, h)
        if isinstance(self.experts, ClampedExperts):  # gpt-oss
            logits, experts = self.router(flat), self.experts
        else:
            logits, experts = self.gate(flat), self._swiglu_experts
        replayed = None if routing is None else routing.reshape(-1, self.top_k)
        weights, chosen = route(
            logits, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob, experts=replayed
        )
        out = dispatch(flat, weights.astype(self.dtype), chosen, self.num_experts, experts)
        if self.shared_expert is not None:
            shared = jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
            out = out + shared
        high = v.compute_dtype(self.dtype)
        out, logits = out.reshape(*lead, h), logits.astype(high).reshape(*lead, self.num_experts)
        return (out, logits, chosen.reshape(*lead, self.top_k)) if return_routing else (out, logits)

    def _swiglu_experts(self, rows: jax.Array, sizes: jax.Array) -> jax.Array:
        """Qwen3-MoE's experts on their runs of `rows` (`dispatch`'s `experts`)."""
        return swiglu_experts(self.experts, self.act, self.implementation, rows, sizes)


def swiglu_experts(
    experts: Mapping[str, "ExpertDense"],
    act: str,
    implementation: GroupedImplementation,
    rows,
    sizes,
) -> jax.Array:
    """SwiGLU experts stored one `ExpertDense` per projection (`gate_proj`, `up_proj`,
    `down_proj`) on their runs of `rows` (`dispatch`'s `experts`)."""
    gate = experts["gate_proj"](rows, sizes, implementation)
    up = experts["up_proj"](rows, sizes, implementation)
    return experts["down_proj"](activation(act)(gate) * up, sizes, implementation)


def dispatch(flat: jax.Array, weights: jax.Array, chosen: jax.Array, num_experts: int, experts):
    r"""$\sum_k w_k\, f_{e_k}(x)$ for each row of `flat [N, H]`, dropless: the $N k$ (row,
    expert) pairs sorted by expert, `experts(rows, group_sizes)` applying each expert to its
    run of rows in grouped products, and the weighted outputs summed back per row."""
    top_k, h = chosen.shape[-1], flat.shape[-1]
    pairs = chosen.reshape(-1)  # (token, choice) pairs, token-major
    order = jnp.argsort(pairs, stable=True)
    sizes = jnp.bincount(pairs, length=num_experts).astype(jnp.int32)
    out = experts(flat[order // top_k], sizes)
    out = (out * weights.reshape(-1)[order][:, None]).astype(flat.dtype)
    return jnp.zeros_like(out).at[order].set(out).reshape(-1, top_k, h).sum(axis=1)


class Router(nnx.Module):
    r"""Gemma 4's router: $z = \hat x\, (g / \sqrt H)\, W$ with $\hat x$ the unscaled
    RMS norm of the layer input, softmax top-$k$ (the chosen probabilities renormalised when
    `config.norm_topk_prob`, as Gemma 4 always does), then each weight multiplied by its
    expert's `per_expert_scale`."""

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        c = config
        self.top_k, self.root = c.num_experts_per_tok, c.hidden_size**-0.5
        self.norm_topk_prob = c.norm_topk_prob
        self.norm = RMSNorm(c.hidden_size, "embed", c, scaled=False, rngs=rngs)
        self.proj = Dense(
            c.hidden_size, c.num_experts, ("embed", "router"), c, use_bias=False, rngs=rngs
        )
        ones = jax.nn.initializers.ones
        self.scale = param(rngs, ones, (c.hidden_size,), ("embed",), c.storage_dtype)
        self.per_expert_scale = param(rngs, ones, (c.num_experts,), ("experts",), c.storage_dtype)

    def __call__(
        self, flat: jax.Array, routing: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`(weights, experts, logits)` for the rows of `flat [N, H]`: `[N, k]` float32
        weights, `[N, k]` expert indices and the `[N, E]` router logits. `routing` `[N, k]`
        replays recorded experts (`route`'s `experts`); their weights still come from these
        logits, times the replayed experts' `per_expert_scale`."""
        dtype = self.proj.dtype
        scale = self.scale[...].astype(dtype) * jnp.asarray(self.root, dtype)
        logits = self.proj(self.norm(flat) * scale)
        weights, chosen = route(
            logits, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob, experts=routing
        )
        weights = weights * self.per_expert_scale[...].astype(weights.dtype)[chosen]
        return weights, chosen, logits


class FusedExperts(nnx.Module):
    """Gemma 4's experts: `gate_up_proj` `[E, H, 2F]` (the gate's `F` columns, then the
    up projection's) and `down_proj` `[E, F, H]`, computed dropless by `dispatch`."""

    def __init__(
        self,
        config: DecoderConfig,
        *,
        implementation: GroupedImplementation = "auto",
        rngs: nnx.Rngs,
    ):
        c = config
        h, f = c.hidden_size, c.moe_intermediate_size
        self.num_experts, self.act, self.implementation = (
            c.num_experts,
            c.hidden_act,
            implementation,
        )
        self.gate_up_proj = ExpertDense(h, 2 * f, ("embed", "mlp"), c, rngs=rngs)
        self.down_proj = ExpertDense(f, h, ("mlp", "embed"), c, rngs=rngs)

    def __call__(self, flat: jax.Array, weights: jax.Array, chosen: jax.Array) -> jax.Array:
        def experts(rows, sizes):
            gate, up = jnp.split(self.gate_up_proj(rows, sizes, self.implementation), 2, axis=-1)
            return self.down_proj(activation(self.act)(gate) * up, sizes, self.implementation)

        return dispatch(flat, weights, chosen, self.num_experts, experts)


def clamped_swiglu(
    gate: jax.Array, up: jax.Array, *, alpha: float | int, limit: float | int
) -> jax.Array:
    r"""gpt-oss's clamped SwiGLU: with $\bar g = \min(g, c)$ and
    $\bar u = \mathrm{clip}(u, -c, c)$, $(\bar u + 1)\, \bar g\, \sigma(\alpha \bar g)$
    ($\alpha$ = `alpha`, $c$ = `limit`)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)


class ClampedExperts(nnx.Module):
    """gpt-oss's experts: `gate_up_proj` `[E, H, 2F]` whose even columns are the gate and odd
    ones the up projection, and `down_proj` `[E, F, H]`, each with a bias; the clamped SwiGLU
    (`clamped_swiglu`) between them. Called with `(rows, group_sizes)` as `dispatch` calls
    its `experts`."""

    def __init__(
        self,
        config: DecoderConfig,
        *,
        implementation: GroupedImplementation = "auto",
        rngs: nnx.Rngs,
    ):
        c = config
        h, f = c.hidden_size, c.moe_intermediate_size
        self.implementation = implementation
        self.alpha, self.limit = c.swiglu_alpha, c.swiglu_limit
        self.gate_up_proj = ExpertDense(h, 2 * f, ("embed", "mlp"), c, use_bias=True, rngs=rngs)
        self.down_proj = ExpertDense(f, h, ("mlp", "embed"), c, use_bias=True, rngs=rngs)

    def __call__(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        gate_up = self.gate_up_proj(rows, group_sizes, self.implementation)
        gated = clamped_swiglu(
            gate_up[..., ::2], gate_up[..., 1::2], alpha=self.alpha, limit=self.limit
        )
        return self.down_proj(gated, group_sizes, self.implementation)
