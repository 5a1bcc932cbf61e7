r"""The divergence of two models' next-token distributions straight from hidden states.

`token_divergence` takes `[N, V]` student and teacher logits, and its gradient holds several
more arrays of that size. Here the logits are computed from the hidden states and the
unembeddings one vocabulary tile at a time and never exist in full: a first pass finds both
log-normalisers, a second sums the divergence's per-entry terms, and a custom VJP recomputes
the tiles in the backward pass.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.logprobs._divergence import DIVERGENCES, Divergence, divergence_terms
from tunelib.logprobs._tiles import (
    cap_slope,
    default_chunk_size,
    tile_logits,
    tile_loop,
    tiles,
    varying_zero,
    vocab_tile,
    write_tiles,
)


def _log_normalisers(student, teacher, tau, chunk, dtype, caps):
    """Pass 1: `log sum_v exp(z_v / tau)` of the student and the teacher, tile by tile."""
    n, vocab = student[0].shape[0], student[1].shape[1]
    chunk, n_tiles = tiles(vocab, chunk)

    def body(index, carry, w, w_t):
        lse = []
        heads = ((student[0], w, student[2]), (teacher[0], w_t, teacher[2]))
        for (h, w, b), running, cap in zip(heads, carry, caps, strict=True):
            _, w_tile, b_tile, owned = vocab_tile(w, b, index, chunk)
            z = jnp.where(owned, tile_logits(h, w_tile, b_tile, tau, dtype, cap), -jnp.inf)
            lse.append(jnp.logaddexp(running, jax.nn.logsumexp(z, axis=-1)))
        return tuple(lse)

    init = jnp.full((n,), -jnp.inf, dtype)
    return tile_loop(0, n_tiles, body, (init, init), (student[1], teacher[1]))


def _tile_terms(student, teacher, lse, index, tau, mix, divergence, chunk, dtype, caps):
    """Tile `index`: its terms as a function of the student's log-probs, and those log-probs.

    Also returns the student's probabilities on the tile, the tile's first column and the
    student's unembedding tile, which the backward pass needs. Columns the tile does not own
    get log-probs 0, probabilities 0 and terms 0.
    """
    (h, w, b), (h_t, w_t, b_t) = student, teacher
    start, w_tile, b_tile, owned = vocab_tile(w, b, index, chunk)
    _, w_t_tile, b_t_tile, _ = vocab_tile(w_t, b_t, index, chunk)
    z = tile_logits(h, w_tile, b_tile, tau, dtype, caps[0])
    log_p = jnp.where(owned, z - lse[0][:, None], 0.0)
    log_p_t = tile_logits(h_t, w_t_tile, b_t_tile, tau, dtype, caps[1]) - lse[1][:, None]
    log_p_t = jnp.where(owned, log_p_t, 0.0)

    def terms(log_p_student):
        values = divergence_terms(log_p_student, log_p_t, divergence, mix)
        return jnp.where(owned, values, 0.0)

    p = jnp.where(owned, jnp.exp(log_p), 0.0)
    return terms, log_p, p, start, w_tile


def _forward(student, teacher, tau, mix, divergence, chunk, caps, with_slope):
    """Pass 2: the divergence per token and, for the backward, `S = sum_v d phi / d log p_v`."""
    n, vocab = student[0].shape[0], student[1].shape[1]
    dtype = tau.dtype
    lse = _log_normalisers(student, teacher, tau, chunk, dtype, caps)
    chunk, n_tiles = tiles(vocab, chunk)

    def body(index, carry, w, w_t):
        total, slope = carry
        heads = (student[0], w, student[2]), (teacher[0], w_t, teacher[2])
        terms, log_p, *_ = _tile_terms(*heads, lse, index, tau, mix, divergence, chunk, dtype, caps)
        if with_slope:
            values, pullback = jax.vjp(terms, log_p)
            (d_log_p,) = pullback(jnp.ones_like(values))
            slope = slope + jnp.sum(d_log_p, axis=-1)
        else:
            values = terms(log_p)
        return total + jnp.sum(values, axis=-1), slope

    zeros = jnp.zeros((n,), dtype)
    total, slope = tile_loop(0, n_tiles, body, (zeros, zeros), (student[1], teacher[1]))
    return total, lse, slope


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused_divergence(student, teacher, tau, mix, divergence, chunk, caps):
    return _forward(student, teacher, tau, mix, divergence, chunk, caps, with_slope=False)[0]


def _fused_divergence_fwd(student, teacher, tau, mix, divergence, chunk, caps):
    total, lse, slope = _forward(
        student, teacher, tau, mix, divergence, chunk, caps, with_slope=True
    )
    return total, (student, teacher, tau, mix, lse, slope)


def _fused_divergence_bwd(divergence, chunk, caps, residuals, g):
    r"""Per tile, $dz = g\,(\partial\phi/\partial \log p - p\,S) / \tau$, then the matmuls."""
    student, teacher, tau, mix, lse, slope = residuals
    h, w, b = student
    dtype = tau.dtype
    chunk, n_tiles = tiles(w.shape[1], chunk)
    coefficient = g.astype(dtype) / tau

    def tile_grads(index, w, w_t, h_t):
        heads = (h, w, b), (teacher[0], w_t, teacher[2])
        terms, log_p, p, start, w_tile = _tile_terms(
            *heads, lse, index, tau, mix, divergence, chunk, dtype, caps
        )
        values, pullback = jax.vjp(terms, log_p)
        (d_log_p,) = pullback(jnp.ones_like(values))
        dz = coefficient[:, None] * (d_log_p - p * slope[:, None])
        dz = dz * cap_slope(log_p + lse[0][:, None], tau, caps[0])  # d/d(h W + b)
        dh = jnp.matmul(dz, w_tile.T.astype(dtype), preferred_element_type=dtype)
        dw_tile = jnp.matmul(h_t, dz, preferred_element_type=dtype)
        return start, dh, dw_tile.astype(w.dtype), jnp.sum(dz, axis=0)

    def tile(index, carry, w, w_t, h_t):
        dh, db = carry
        start, tile_dh, dw_tile, db_tile = tile_grads(index, w, w_t, h_t)
        if db is not None:
            db = lax.dynamic_update_slice_in_dim(db, db_tile, start, axis=0)
        return (dh + tile_dh, db), start, dw_tile

    # As in `fused_token_logps`: each tile writes its own columns of the unembedding's gradient
    # once, in the unembedding's dtype; d hidden accumulates over the tiles in `dtype`.
    zero = varying_zero(h, w, b, *teacher, tau, mix, lse[0], lse[1], slope, g)
    init = (
        jnp.zeros(h.shape, dtype) + zero.astype(dtype),
        None if b is None else jnp.zeros(b.shape, dtype) + zero[0].astype(dtype),
    )
    (dh, db), dw = write_tiles(
        tile, init, (w, teacher[1], h.T.astype(dtype)), n_tiles=n_tiles, chunk=chunk,
        shape=w.shape, dtype=w.dtype, zero=zero,
    )  # fmt: skip
    d_student = (dh.astype(h.dtype), dw, None if b is None else db.astype(b.dtype))
    # The teacher, the temperature and the mixture weight are data: no cotangent for them.
    return d_student, None, None, None


_fused_divergence.defvjp(_fused_divergence_fwd, _fused_divergence_bwd)


def _checked_head(
    hidden: ArrayLike, unembedding: ArrayLike, bias: ArrayLike | None, model: str
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """One model's hidden states, unembedding `[H, V]` and bias `[V]`, checked."""
    hidden = v.float_array(hidden, f"{model}_hidden")
    v.check_ndim(hidden, f"{model}_hidden", at_least=1)
    unembedding = v.float_array(unembedding, f"{model}_unembedding")
    if unembedding.ndim != 2 or unembedding.shape[0] != hidden.shape[-1]:
        raise ValueError(
            f"{model}_unembedding must have shape [H, V] with H = {hidden.shape[-1]} "
            f"({model}_hidden's last axis), got {tuple(unembedding.shape)}."
        )
    if unembedding.shape[1] == 0:
        raise ValueError(f"{model}_unembedding has no vocabulary column: {unembedding.shape}.")
    if bias is not None:
        bias = v.float_array(bias, f"{model}_bias")
        v.check_shape(
            bias, f"{model}_bias", unembedding.shape[1:], f"{model}_unembedding {unembedding.shape}"
        )
    return hidden, unembedding, bias


def fused_divergence(
    student_hidden: Float[ArrayLike, "*B Hs"],
    student_unembedding: Float[ArrayLike, "Hs V"],
    teacher_hidden: Float[ArrayLike, "*B Ht"],
    teacher_unembedding: Float[ArrayLike, "Ht V"],
    *,
    divergence: Divergence = "forward_kl",
    mix: Scalar = 0.5,
    normalize: bool = True,
    temperature: Scalar = 1.0,
    student_bias: Float[ArrayLike, " V"] | None = None,
    teacher_bias: Float[ArrayLike, " V"] | None = None,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    where: Mask[ArrayLike, "*B"] | None = None,
    chunk_size: int | None = None,
) -> Float[Array, "*B"]:
    r"""Per-token divergence of two models' distributions from their hidden states, no logits.

    $$
    D_n = c \sum_{k} \sum_{v \in \mathcal{V}_k}
    \phi\big(\log p^S_{n,v}, \log p^T_{n,v}\big), \qquad
    \log p_{n,v} = \frac{z_{n,v}}{\tau} - \log \sum_{k'} \sum_{u \in \mathcal{V}_{k'}}
    e^{z_{n,u}/\tau}, \qquad z^S_n = \mathrm{cap}_S(h^S_n W^S + b^S), \quad
    z^T_n = \mathrm{cap}_T(h^T_n W^T + b^T)
    $$

    with hidden states $h^S$ = `student_hidden`, $h^T$ = `teacher_hidden`, unembeddings
    $W^S$ = `student_unembedding`, $W^T$ = `teacher_unembedding`, biases $b^S$ =
    `student_bias`, $b^T$ = `teacher_bias`, temperature $\tau$ = `temperature`, vocabulary
    tiles $\mathcal{V}_k$ of `chunk_size` columns, $\mathrm{cap}(l) = c \tanh(l / c)$ each
    model's final-logit soft-capping (`student_softcap`, `teacher_softcap`; the identity when
    None), $\phi$ the per-entry term of the divergence
    named by `divergence` and $c$ = $\beta (1 - \beta)$ for the unnormalised JSD, 1 otherwise.
    The value equals, to float32 rounding, `token_divergence` of the logits $z^S$ and $z^T$
    with the same `divergence`, `mix` ($\beta$), `normalize` and `temperature`: the forward KL
    $\mathrm{KL}(p^T \| p^S)$ (Hinton et al.), the reverse KL $\mathrm{KL}(p^S \| p^T)$
    (MiniLLM) or GKD's generalized JSD. Both functions sum the same per-entry terms. The
    distillation losses of `tunelib.losses` are these values times $\tau^2$ (Hinton et al.'s
    factor): multiply by ``temperature**2`` for them.

    A first pass streams the tiles for both log-normalisers; a second sums the terms, and, when
    differentiated, also $S_n = \sum_v \partial\phi / \partial \log p^S_{n,v}$. The custom VJP
    saves only these per-token values besides the inputs and recomputes each tile:
    $\partial D_n / \partial z^S_{n,v} = c\,(\partial\phi / \partial \log p^S_{n,v} -
    p^S_{n,v} S_n) / \tau$, multiplied into $W^{S\top}$ for the hidden states and by
    $h^{S\top}$ for the tile of the unembedding. Temporary memory does not grow with $V$: about
    2 `[N, chunk_size]` float32 arrays for the value, 10 (KL) to 20 (JSD) with gradients (XLA
    CPU), against several `[N, V]` arrays for materialised logits. Each tile's logits are
    computed twice for the value and a third time in the backward pass: $4NV(H_S + H_T)$ flops
    without gradients, $10 N V H_S + 6 N V H_T$ with them.

    **Gradients reach only the student**: `student_hidden`, `student_unembedding` and
    `student_bias`. The teacher is data: its hidden states, unembedding and bias get zero
    cotangents (unlike `token_divergence`, where gradients flow into `teacher_logits`), and so
    do `temperature` and `mix`.

    This is the head that was `tunelib.losses.fused_distillation_loss`, which still works until
    tunelib 0.3.0 (with its $\tau^2$ factor and its `beta`), with a `DeprecationWarning`.

    Args:
      student_hidden: `[..., Hs]` student hidden states, any float dtype (matmuls accumulate
        in float32).
      student_unembedding: `[Hs, V]` the student's unembedding.
      teacher_hidden: `[..., Ht]` teacher hidden states at the same positions.
      teacher_unembedding: `[Ht, V]` the teacher's unembedding over the same vocabulary.
      divergence: ``"forward_kl"`` (default), ``"reverse_kl"`` or ``"jsd"`` (static).
      mix: $\beta \in [0, 1]$ of ``"jsd"``, the teacher's weight in the mixture; ignored
        otherwise; may be traced.
      normalize: for ``"jsd"``, divide by $\beta (1 - \beta)$ (static; see
        `token_divergence`); ignored otherwise.
      temperature: $\tau > 0$, applied to both models; may be traced.
      student_bias: optional `[V]` bias of the student's unembedding.
      teacher_bias: optional `[V]` bias of the teacher's unembedding.
      student_softcap: $c > 0$ of the student's final-logit soft-capping (static), or None.
      teacher_softcap: the same for the teacher.
      where: `[...]` mask, True (or 1) = counts. Masked positions give exactly 0 and send
        exactly 0 gradient, even when their hidden states are NaN.
      chunk_size: vocabulary tile width (static); any `V` works, not only multiples of it.
        None picks `default_chunk_size` of the number of tokens, as `fused_token_logps` does.

    Returns:
      `[...]` per-token divergences, float32 (float64 for float64 inputs).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.logprobs import fused_divergence, token_divergence
      >>> h_s, w_s = jnp.array([[1.0, 0.0]]), jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
      >>> h_t, w_t = jnp.array([[2.0]]), jnp.array([[1.0, 0.0, -0.5]])
      >>> print(fused_divergence(h_s, w_s, h_t, w_t, chunk_size=2).round(4))
      [0.1834]
      >>> print(token_divergence((h_s @ w_s)[None], (h_t @ w_t)[None]).round(4))
      [[0.1834]]
      >>> print(fused_divergence(h_s, w_s, h_t, w_t, divergence="jsd", mix=0.5).round(4))
      [0.2047]

    References:
      Hinton et al., "Distilling the Knowledge in a Neural Network", 2015,
      https://arxiv.org/abs/1503.02531.
      Gu et al., "MiniLLM: Knowledge Distillation of Large Language Models", 2024,
      https://arxiv.org/abs/2306.08543.
      Agarwal et al., "On-Policy Distillation of Language Models: Learning from
      Self-Generated Mistakes" (GKD), 2024, https://arxiv.org/abs/2306.13649.
      Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024,
      https://arxiv.org/abs/2411.09009 (the tiled, recomputing head, for the cross-entropy).
    """
    h_s, w_s, b_s = _checked_head(student_hidden, student_unembedding, student_bias, "student")
    h_t, w_t, b_t = _checked_head(teacher_hidden, teacher_unembedding, teacher_bias, "teacher")
    shape = h_s.shape[:-1]
    v.check_shape(
        h_t,
        "teacher_hidden",
        (*shape, h_t.shape[-1]),
        f"student_hidden {tuple(h_s.shape)} on every axis but the last",
    )
    v.check_shape(
        w_t,
        "teacher_unembedding",
        (h_t.shape[-1], w_s.shape[1]),
        f"teacher_hidden's H and the V of student_unembedding {tuple(w_s.shape)}",
    )
    v.one_of(divergence, "divergence", DIVERGENCES)
    if divergence == "jsd":
        v.unit_interval(mix, "mix")
    v.positive_scalar(temperature, "temperature")
    caps = (
        v.softcap(student_softcap, "student_softcap"),
        v.softcap(teacher_softcap, "teacher_softcap"),
    )
    if chunk_size is None:
        chunk_size = default_chunk_size(math.prod(shape))
    v.static_count(chunk_size, "chunk_size")
    where = v.mask_array(where, shape)
    arrays = [x for x in (h_s, w_s, b_s, h_t, w_t, b_t) if x is not None]
    dtype = v.compute_dtype(*(x.dtype for x in arrays))
    tau = lax.stop_gradient(jnp.asarray(temperature, dtype))
    mix = lax.stop_gradient(jnp.asarray(mix, dtype))
    h_s = jnp.where(where[..., None], h_s, 0).reshape(-1, h_s.shape[-1])
    h_t = jnp.where(where[..., None], h_t, 0).reshape(-1, h_t.shape[-1])
    student, teacher = (h_s, w_s, b_s), (h_t, w_t, b_t)
    total = _fused_divergence(student, teacher, tau, mix, divergence, chunk_size, caps)
    if divergence == "jsd" and not normalize:
        total = mix * (1 - mix) * total
    return jnp.where(where, total.reshape(shape), 0.0)
