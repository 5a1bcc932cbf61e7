r"""DeepSeekMoE (DeepSeek-V3): sigmoid scores, group-limited top-k routing on scores plus a
balancing bias, shared experts beside the routed ones, and the bias's update rule."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from tunelib import _validation as v
from tunelib.models._config import DecoderConfig
from tunelib.models._layers import MLP, kernel_init, param
from tunelib.models._moe import ExpertDense, dispatch, swiglu_experts


def route_grouped(
    router_logits: Float[ArrayLike, "*N E"],
    expert_bias: Float[ArrayLike, " E"],
    *,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float | ArrayLike = 1.0,
    experts: Int[ArrayLike, "*N k"] | None = None,
) -> tuple[Float[Array, "*N k"], Int[Array, "*N k"]]:
    r"""DeepSeek-V3's routing: sigmoid scores, experts chosen on the scores plus a bias within
    the best groups, weighted by the scores alone.

    With scores $s_e = \sigma(z_e)$ and the balancing bias $b_e$ (`expert_bias`, transformers'
    `e_score_correction_bias`), the experts form $G$ groups of $E / G$; a group's score is the
    sum of its two largest $s_e + b_e$, and the token's candidates are the experts of its
    `topk_group` best groups. The chosen $\mathcal{K}$ are the $k$ candidates of largest
    $s_e + b_e$: the bias only chooses. Their weights are

    $$ w_e = \rho\, \frac{s_e}{\sum_{j \in \mathcal{K}} s_j + 10^{-20}}
    \quad\text{(or } \rho\, s_e \text{ without `norm\_topk\_prob`)}, \qquad e \in \mathcal{K}, $$

    with $\rho$ = `routed_scaling_factor`, in at least float32. With `experts` given
    (routing replay) $\mathcal{K}$ is read from it and the weights are the same formula.

    Args:
      router_logits: `[..., E]` router logits $z$.
      expert_bias: `[E]` bias $b$ added to the scores for choosing only.
      top_k: $k$ (static).
      n_group: $G$, dividing $E$ into groups of at least 2 experts (static).
      topk_group: groups each token chooses among (static).
      norm_topk_prob: renormalise the chosen scores to sum to 1.
      routed_scaling_factor: $\rho$; may be traced.
      experts: `[..., k]` recorded expert ids to route to; None chooses as above.

    Returns:
      `(weights, experts)`: `[..., k]` float weights and `[..., k]` int32 expert ids.

    References:
      DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, sec. 2.1.2,
      https://arxiv.org/abs/2412.19437.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.models import route_grouped
      >>> logits = jnp.array([2.0, 1.0, -1.0, 0.5])
      >>> weights, experts = route_grouped(logits, jnp.zeros(4), top_k=2, n_group=2,
      ...                                  topk_group=1, routed_scaling_factor=2.0)
      >>> print(experts, weights.round(3))
      [0 1] [1.093 0.907]

      A bias moves the choice, not the weights' formula:

      >>> weights, experts = route_grouped(logits, jnp.array([0.0, 0.0, 0.0, 2.0]), top_k=2,
      ...                                  n_group=2, topk_group=1)
      >>> print(experts, weights.round(4))
      [3 2] [0.6983 0.3017]
    """
    logits = v.float_array(router_logits, "router_logits")
    high = v.compute_dtype(logits.dtype)
    e = logits.shape[-1] if logits.ndim else 0
    if e % n_group or e // n_group < 2:
        raise ValueError(
            f"n_group ({n_group}) must divide the {e} experts of router_logits into groups of "
            "at least 2."
        )
    bias = v.float_array(expert_bias, "expert_bias")
    v.check_shape(bias, "expert_bias", (e,), f"router_logits {logits.shape}")
    scores = jax.nn.sigmoid(logits.astype(high))
    if experts is None:
        choice = scores + bias.astype(high)
        grouped = choice.reshape(*choice.shape[:-1], n_group, e // n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
        best = jax.lax.top_k(group_scores, topk_group)[1]
        kept = jnp.any(best[..., :, None] == jnp.arange(n_group), axis=-2)
        kept = jnp.repeat(kept, e // n_group, axis=-1)
        chosen = jax.lax.top_k(jnp.where(kept, choice, -jnp.inf), top_k)[1]
    else:
        chosen = v.int_array(experts, "experts")
        v.check_shape(chosen, "experts", (*logits.shape[:-1], top_k), f"top_k={top_k}")
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * jnp.asarray(routed_scaling_factor, high), chosen.astype(jnp.int32)


def expert_bias_update(
    expert_bias: Float[ArrayLike, "*M E"],
    expert_load: Float[ArrayLike, "*M E"],
    *,
    rate: float | ArrayLike = 1e-3,
) -> Float[Array, "*M E"]:
    r"""DeepSeek-V3's auxiliary-loss-free balancing: one update of the routing bias.

    $$ b_e \leftarrow b_e + \gamma\, \mathrm{sign}(\bar c - c_e), \qquad
    \bar c = \frac{1}{E} \sum_j c_j $$

    with $c_e$ the tokens routed to expert $e$ in the step (`expert_load`), $b$ the bias
    (`expert_bias`, the `e_score_correction_bias` that `route_grouped` adds to the scores to
    choose experts) and $\gamma$ = `rate`: an overloaded expert's bias falls by $\gamma$, an
    underloaded one's rises, one at the mean is left. Leading axes (one per layer) are
    updated independently. It is not a gradient step: apply it to the bias after the
    optimizer step, outside the loss.

    Args:
      expert_bias: `[..., E]` biases.
      expert_load: `[..., E]` tokens (or token fractions) per expert, e.g.
        `jnp.bincount(routing[l].ravel(), length=E)` from a model's `return_routing`.
      rate: $\gamma$, the bias update speed (DeepSeek-V3: 0.001); may be traced.

    Returns:
      The updated `[..., E]` biases, in the bias's dtype (at least float32).

    References:
      DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, sec. 2.1.2,
      https://arxiv.org/abs/2412.19437.
      Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts",
      2024, https://arxiv.org/abs/2408.15664.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.models import expert_bias_update
      >>> print(expert_bias_update(jnp.zeros(4), jnp.array([6.0, 2.0, 4.0, 4.0]), rate=0.01))
      [-0.01  0.01  0.    0.  ]
    """
    bias = v.float_array(expert_bias, "expert_bias")
    load = v.float_array(expert_load, "expert_load")
    v.check_shape(load, "expert_load", bias.shape, f"expert_bias {bias.shape}")
    high = v.compute_dtype(bias.dtype)
    load = load.astype(high)
    step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return bias.astype(high) + jnp.asarray(rate, high) * step


class GroupedRouter(nnx.Module):
    """DeepSeek-V3's router (`mlp/gate`): a `[H, E]` kernel applied in float32 and the
    balancing bias `e_score_correction_bias` `[E]`, which chooses experts and receives no
    gradient (update it with `expert_bias_update`)."""

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        shape = (c.hidden_size, c.num_experts)
        self.kernel = param(rngs, kernel_init(c), shape, ("embed", "router"), c.storage_dtype)
        zeros = jax.nn.initializers.zeros
        self.e_score_correction_bias = param(
            rngs, zeros, (c.num_experts,), ("router",), c.storage_dtype
        )

    def __call__(
        self, flat: jax.Array, routing: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`(weights, experts, logits)` for the rows of `flat [N, H]` (`route_grouped`)."""
        c = self.config
        high = v.compute_dtype(flat.dtype)
        logits = flat.astype(high) @ self.kernel[...].astype(high)
        bias = jax.lax.stop_gradient(self.e_score_correction_bias[...])
        weights, chosen = route_grouped(
            logits,
            bias,
            top_k=c.num_experts_per_tok,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
            experts=routing,
        )
        return weights, chosen, logits


class DeepSeekMoE(nnx.Module):
    r"""DeepSeek-V3's mixture of experts: routed SwiGLU experts chosen by `GroupedRouter`
    (`gate`), computed dropless as Qwen3-MoE's (`experts/{gate,up,down}_proj/kernel`
    `[E, in, out]`, saved one tensor per expert as transformers saves them), plus the
    shared experts, one dense SwiGLU `n_shared_experts` times `moe_intermediate_size` wide
    that every token goes through:

    $$ y = \mathrm{MLP}_{shared}(x) + \sum_{e \in \mathcal{K}} w_e\, \mathrm{FFN}_e(x) $$

    Called as `tunelib.models.MoE` is: `(out, logits)` or, with `return_routing`,
    `(out, logits, experts)`; the logits are the router's, before the sigmoid.

    References:
      Dai et al., "DeepSeekMoE: Towards Ultimate Expert Specialization in Mixture-of-Experts
      Language Models", 2024, https://arxiv.org/abs/2401.06066.
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        c = config
        h, f = c.hidden_size, c.moe_intermediate_size
        self.top_k, self.num_experts, self.act = c.num_experts_per_tok, c.num_experts, c.hidden_act
        self.dtype = c.compute_dtype
        self.gate = GroupedRouter(c, rngs=rngs)
        self.experts = nnx.Dict(
            gate_proj=ExpertDense(h, f, ("embed", "mlp"), c, rngs=rngs),
            up_proj=ExpertDense(h, f, ("embed", "mlp"), c, rngs=rngs),
            down_proj=ExpertDense(f, h, ("mlp", "embed"), c, rngs=rngs),
        )
        shared = c.n_shared_experts * c.moe_intermediate_size
        self.shared_experts = MLP(c, width=shared, rngs=rngs) if shared else None

    def __call__(
        self, x: jax.Array, routing: jax.Array | None = None, *, return_routing: bool = False
    ) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, jax.Array]:
        *lead, h = x.shape
        flat = x.reshape(-1, h)
        replayed = None if routing is None else routing.reshape(-1, self.top_k)
        weights, chosen, logits = self.gate(flat, replayed)

        def experts(rows, sizes):
            return swiglu_experts(self.experts, self.act, "auto", rows, sizes)

        out = dispatch(flat, weights.astype(self.dtype), chosen, self.num_experts, experts)
        out = out.reshape(x.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        logits = logits.reshape(*lead, -1)
        return (out, logits, chosen.reshape(*lead, self.top_k)) if return_routing else (out, logits)
