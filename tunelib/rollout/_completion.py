"""Log-probs of sampled completions under a model, with the shift to the next token done once."""

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange, repeat
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, PyTree

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.logprobs import IMPLEMENTATIONS, fused_token_logps
from tunelib.rollout._decoding import checked_images


def completion_logps(
    graphdef: nnx.GraphDef,
    params: PyTree,
    prompt_tokens: Int[ArrayLike, "B P"],
    prompt_where: Mask[ArrayLike, "B P"],
    tokens: Int[ArrayLike, "R N"],
    where: Mask[ArrayLike, "R N"],
    *,
    temperature: Scalar = 1.0,
    with_entropy: bool = False,
    implementation: str = "auto",
    share_prompts: bool = True,
    routing: Int[ArrayLike, "R T M k"] | None = None,
    images: Mapping[str, ArrayLike] | None = None,
) -> Float[Array, "R N"] | tuple[Float[Array, "R N"], Float[Array, "R N"]]:
    r"""Log-probs (and entropy) of completion tokens after their prompts, under `params`.

    $$
    \log \pi_\theta(y_j \mid x, y_{<j}) = \Big[\log \mathrm{softmax}\big(h_{s(j)}\, U / \tau
    \big)\Big]_{y_j}, \qquad
    H_j = -\sum_v \pi_{j,v} \log \pi_{j,v}
    $$

    where $h$ are the decoder's hidden states over the concatenation $[x; y]$ of a prompt and
    its completion, $s(j)$ is the last real position before completion token $y_j$ (the last
    real prompt token for $j = 0$, wherever the prompt's padding is), $U$ the unembedding and
    $\tau$ the temperature. $x$ = `prompt_tokens` (real where `prompt_where`), $y$ =
    `tokens` (real where `where`), $\tau$ = `temperature`, $\theta$ = `params`. The log-probs
    come from the fused head (`tunelib.logprobs.fused_token_logps`), so no `[R, N, V]`
    logits are formed, and are exactly 0 (with zero gradient) where `where` is False.

    It takes a `Rollout` as `sample` returns it: `completion_logps(graphdef, params,
    prompt_tokens, prompt_where, out.tokens, out.where, temperature=τ)` recomputes
    `out.logps` (with `logps_of="tempered"`, the default) up to float rounding. The group
    size G of `sample(..., group_size=G)` is read from the shapes (there is no `group_size`
    argument): the `R = B * G` completions follow the `B` prompts (row `b * G + g`
    continues prompt `b`). Wrap it in `tunelib.peft.lora` to score under adapters:
    `peft.lora(completion_logps)(graphdef, peft.apply_lora(params, adapters), ...)`.

    Each prompt needs at least one real token, as for `sample`. With groups (`R = B * G`,
    G > 1) and `share_prompts` (the default), each prompt is run once, into a KV cache that
    its G completions then attend to (`Decoder.extend`, as `sample` runs them): the layers
    see `B * P + R * N` tokens instead of `R * (P + N)` (the projections' and MLPs' FLOPs
    fall in that ratio, 1.8x for P = N and G = 8), the completions' attention scores
    `R * N * (P + N)` query-key pairs instead of `R * (P + N)^2`, and gradients reach the
    prompt's keys and values through every completion of its group. The values and
    gradients equal those of the concatenated forward pass up to float rounding: the
    attention over the cache sums in another order, and XLA's products sum in an order
    that depends on their shapes. In float32 the two passes are as far apart as either is
    from the same weights in float64 (the tests hold them within 4x of that; a few 1e-7
    relative for small decoders); a tolerance fixed in advance would hold on one CPU and
    not another. The program is about twice as large (the layers run twice, each with its
    backward pass), so it compiles for longer (2.3 to 4x in `benchmarks/shared_prompts.py`,
    where a GRPO update at P = N = 64, G = 8 runs 1.6 to 1.7x faster). `share_prompts=False`
    runs the concatenated pass, each prompt once per completion, as TRL and Tunix do.

    Routing replay (R3): for a mixture-of-experts model, `routing=rollout.routing` from
    `sample(..., record_routing=True)` routes every prompt and completion token to the
    experts the sampler chose, in every MoE layer, while the gate weights over them are
    computed (and differentiated) from this forward pass's own router logits
    (`tunelib.models.route` with `experts`). The sampler's cached decode and this full
    forward pass round differently, and in bfloat16 two experts near a tie can swap between
    them: a token then goes through other experts here than it did at rollout, and its
    log-prob differs by far more than rounding. Replayed, the experts are the same, and
    what is left is the rounding of the dense computation. With shared prompts, each
    prompt's columns of `routing` are read from the first completion of its group (the
    sampler records one prefill for the group); a concrete `routing` whose rows of one group
    route a real prompt token differently is refused.

    Note:
      TRL and Tunix slice the logits of left-padded prompts at `[P - 1, P + N - 1)` and
      divide them by the temperature; this is the same computation, for prompts padded on
      either side.

    Args:
      graphdef: the `nnx.GraphDef` of a `tunelib.models.Decoder` or
        `tunelib.models.VisionLanguageModel` (static).
      params: its parameters (an `nnx.State` or the pure dict of one); inside
        `tunelib.peft.lora`, adapted or quantised weights.
      prompt_tokens: `[B, P]` prompt token ids.
      prompt_where: `[B, P]` mask, True (or 1) on real prompt tokens.
      tokens: `[R, N]` completion token ids, `R = B * G`.
      where: `[R, N]` mask, True (or 1) on the completion tokens to score.
      temperature: $\tau > 0$; may be traced.
      with_entropy: also return the per-token entropy $H_j$ (static).
      implementation: the fused head's implementation, one of
        `tunelib.logprobs.IMPLEMENTATIONS` (static; "auto" picks per backend).
      share_prompts: with groups, run each prompt once and its completions over its KV
        cache (static; default True); False: one forward pass over each prompt and
        completion concatenated.
      routing: `[R, P + N, M, k]` int32 experts to route each prompt and completion token
        to in the model's M mixture-of-experts layers (`Rollout.routing`, rows first);
        None (the default) routes by the router's own top-k.
      images: for a `tunelib.models.VisionLanguageModel`, the prompts' images as `sample`
        takes them (the arrays the model's `image_inputs` names), encoded once per
        prompt; with groups they need
        `share_prompts`. None: text only.

    Returns:
      `[R, N]` float32 log-probs; with `with_entropy`, the pair `(logps, entropy)`.

    Raises:
      ValueError: for `routing` whose rows and columns are not `[R, P + N]`; the model
        refuses one with another layer count or k, with expert ids outside `[0, E)`, or
        given to a model without mixture-of-experts layers (`tunelib.models.Decoder`);
        with shared prompts, for a concrete `routing` whose rows of one group differ at a
        real prompt token.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from tunelib.models import Decoder, DecoderConfig
      >>> from tunelib.rollout import SamplingConfig, completion_logps, sample
      >>> cfg = DecoderConfig(vocab_size=16, hidden_size=32, intermediate_size=64,
      ...                     num_hidden_layers=1, num_attention_heads=2, head_dim=16)
      >>> graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
      >>> prompts = jnp.array([[0, 3, 4], [5, 6, 7]])
      >>> prompt_where = jnp.array([[False, True, True], [True, True, True]])
      >>> out = sample(graphdef, params, prompts, prompt_where, jax.random.key(0),
      ...              SamplingConfig(max_new_tokens=4, temperature=0.7), group_size=2)
      >>> score = jax.jit(completion_logps, static_argnums=0)  # the graphdef is static
      >>> logps = score(graphdef, params, prompts, prompt_where, out.tokens, out.where,
      ...               temperature=0.7)
      >>> print(logps.shape, bool(jnp.allclose(logps, out.logps, atol=1e-5)))
      (4, 4) True
      >>> tokens, where = jnp.array([[9, 2, 0]]), jnp.array([[True, True, False]])
      >>> print(score(graphdef, params, prompts[:1], prompt_where[:1], tokens, where).round(2))
      [[-2.68 -2.61  0.  ]]

    References:
      Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
      Language Models" (GRPO, which scores its samples this way), 2024,
      https://arxiv.org/abs/2402.03300.
      Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
      Routers" (R3, `routing`), 2025, https://arxiv.org/abs/2510.11370.
    """
    prompt_tokens = v.int_array(prompt_tokens, "prompt_tokens")
    if prompt_tokens.ndim != 2:
        raise ValueError(f"prompt_tokens must have shape [B, P], got {prompt_tokens.shape}.")
    prompt_where = v.mask_array(prompt_where, prompt_tokens.shape, "prompt_where")
    tokens = v.int_array(tokens, "tokens")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape [R, N], got {tokens.shape}.")
    where = v.mask_array(where, tokens.shape, "where")
    v.one_of(implementation, "implementation", IMPLEMENTATIONS)
    (batch, prompt_len), (rows, _) = prompt_tokens.shape, tokens.shape
    if rows % batch:
        raise ValueError(
            f"tokens has {rows} rows, which is not a multiple of the {batch} prompts of "
            f"prompt_tokens {prompt_tokens.shape}: row b * G + g must continue prompt b."
        )
    length = prompt_len + tokens.shape[1]
    if routing is not None:
        routing = v.int_array(routing, "routing")
        if routing.ndim != 4 or routing.shape[:2] != (rows, length):
            raise ValueError(
                f"routing has shape {routing.shape} but must have shape [{rows}, {length}, "
                f"M, k]: [R, P + N, M, k] for the {rows} completions of tokens "
                f"{tokens.shape} after prompts of prompt_tokens {prompt_tokens.shape} "
                "(Rollout.routing as sample(..., record_routing=True) records it)."
            )
    group = rows // batch
    images = checked_images(graphdef, params, images, prompt_tokens, prompt_where) or {}
    if images and group > 1 and not share_prompts:
        raise ValueError(
            "images are encoded once per prompt: with groups (G > 1) they need share_prompts=True."
        )
    if routing is not None:
        if group > 1 and share_prompts:
            _check_one_prompt_routing_a_group(routing, prompt_where, group)
        routing = rearrange(routing, "r t m k -> m r t k")  # the decoder's layout
    model = nnx.merge(graphdef, params)
    if group > 1 and share_prompts:
        # Each prompt once into a KV cache, the cache repeated over its group, then every
        # completion on top of it: the hidden states of the concatenation, as `sample` has them.
        cache = model.init_cache(batch, length)
        prompt_routing, completion_routing = (
            (None, None)
            if routing is None
            else (routing[:, ::group, :prompt_len], routing[:, :, prompt_len:])
        )
        prompt_hidden, cache = model.extend(
            prompt_tokens, prompt_where, cache, routing=prompt_routing, **images
        )
        cache = cache.repeat_rows(group)
        completion_hidden, _ = model.extend(tokens, where, cache, routing=completion_routing)
        prompt_hidden = repeat(prompt_hidden, "b p h -> (b g) p h", g=group)
        hidden = jnp.concatenate([prompt_hidden, completion_hidden], axis=1)
        prompt_where = repeat(prompt_where, "b p -> (b g) p", g=group)
        all_where = jnp.concatenate([prompt_where, where], axis=1)
    else:
        if group > 1:  # each prompt run again for each of its G completions
            prompt_tokens = repeat(prompt_tokens, "b p -> (b g) p", g=group)
            prompt_where = repeat(prompt_where, "b p -> (b g) p", g=group)
        all_where = jnp.concatenate([prompt_where, where], axis=1)
        hidden = model(
            jnp.concatenate([prompt_tokens, tokens], axis=1),
            where=all_where,
            routing=routing,
            **images,
        )
    # Completion token j sits at column P + j and is predicted by the last real column
    # before it: a running max of the real columns' indices, read at P - 1 + j.
    columns = jnp.arange(all_where.shape[1] - 1)
    last_real = jax.lax.cummax(jnp.where(all_where[:, :-1], columns, 0), axis=1)
    source = last_real[:, prompt_len - 1 :]
    hidden = jnp.take_along_axis(hidden, source[..., None], axis=1)
    return fused_token_logps(
        hidden,
        model.unembedding(),
        tokens,
        temperature=temperature,
        softcap=model.config.final_logit_softcapping,
        with_entropy=with_entropy,
        where=where,
        implementation=implementation,
    )


def _check_one_prompt_routing_a_group(
    routing: jax.Array, prompt_where: jax.Array, group: int
) -> None:
    """Refuse a concrete `[R, P + N, M, k]` `routing` whose rows of one group route a real
    prompt token to different experts: shared prompts run each prompt once, so its routing
    is one record per group (a traced one cannot be read; its group's first row is used)."""
    if isinstance(routing, jax.core.Tracer) or isinstance(prompt_where, jax.core.Tracer):
        return
    if not getattr(routing, "is_fully_addressable", True):
        return
    prompt_len = prompt_where.shape[1]
    ids = rearrange(np.asarray(routing[:, :prompt_len]), "(b g) p m k -> b g p (m k)", g=group)
    differs = (ids != ids[:, :1]).any(axis=(1, 3)) & np.asarray(prompt_where)  # [B, P]
    if differs.any():
        b, p = np.argwhere(differs)[0]
        raise ValueError(
            f"routing routes real token {p} of prompt {b} to different experts in the rows of "
            f"its group (rows {b * group} to {b * group + group - 1}); with share_prompts=True "
            "each prompt runs once, so its columns of routing must be one record for the "
            "group, as sample(..., group_size=G, record_routing=True) makes it; pass "
            "share_prompts=False to replay a routing per row."
        )
