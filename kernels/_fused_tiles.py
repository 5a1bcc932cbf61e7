"""The per-tile arithmetic of the fused log-prob kernels, shared by the GPU and TPU lowerings.

Everything here is a pure function of arrays already loaded from refs: one tile of logits
`[block_n, block_v]` and the per-token column vectors `[block_n, 1]` that go with it. Column
vectors (rather than `[block_n]`) keep every operand 2-D, which both Mosaic and Triton lay out
without reshapes.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


class Config(NamedTuple):
    """The static description of one kernel launch (hashable: a `custom_vjp` static argument)."""

    platform: str  # "gpu" (Triton) or "tpu" (Mosaic)
    block_n: int
    block_v: int
    block_h: int  # hidden-dimension chunk of the GPU matmuls; the TPU holds all of H
    vocab: int  # true V; padded columns at or beyond it get -inf logits
    with_entropy: bool
    interpret: bool
    softcap: float | None = None  # final-logit soft-capping c tanh(u / c), before 1 / tau


class Stats(NamedTuple):
    """The online log-sum-exp state of a block of tokens, each field `[block_n, 1]`.

    `m` is the running maximum, `s0 = sum_v exp(z_v - m)`, `s1 = sum_v exp(z_v - m) (z_v - m)`
    (kept only for the entropy) and `zt` the target logit. Measuring `s1` from the running
    maximum rather than from 0 keeps the entropy `log s0 - s1 / s0` free of the cancellation
    that `lse - E_p[z]` suffers when the logits are large.
    """

    m: jax.Array
    s0: jax.Array
    s1: jax.Array
    zt: jax.Array


# Contracted axes of `dot` for a @ b, a @ b^T and a^T @ b.
NN, NT, TN = (1, 0), (1, 1), (0, 0)


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int], dtype) -> jax.Array:
    """`a @ b` contracting axis `contract[0]` of `a` with `contract[1]` of `b`, into `dtype`.

    Full precision for 32-bit operands (no TF32 on GPU, no bf16 passes on TPU); the native
    matrix units for 16-bit operands, always accumulating in `dtype`.
    """
    precision = lax.Precision.HIGHEST if a.dtype.itemsize >= 4 else lax.Precision.DEFAULT
    numbers = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, numbers, precision=precision, preferred_element_type=dtype)


def columns(index: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Global vocabulary ids `[block_n, block_v]` of vocabulary tile `index`."""
    return index * shape[1] + lax.broadcasted_iota(jnp.int32, shape, 1)


def scale_logits(
    hw: jax.Array,
    bias: jax.Array,
    inv_temperature: jax.Array,
    cols: jax.Array,
    vocab: int,
    softcap: float | None = None,
) -> jax.Array:
    """`z = cap(h W + b) / tau` for one tile, with `-inf` in the padded columns; `cap(u)` is
    `c tanh(u / c)` with `softcap` c, or `u` for None."""
    u = hw + bias.astype(hw.dtype)
    if softcap is not None:
        u = softcap * jnp.tanh(u / softcap)
    return jnp.where(cols < vocab, u * inv_temperature, -jnp.inf)


def input_cotangent(
    dz: jax.Array, z: jax.Array, inv_temperature: jax.Array, softcap: float | None
) -> jax.Array:
    """`d/du` of the logits' input `u = h W + b` from `dz`: `dz / tau`, times the cap's slope
    `1 - tanh^2(u / c)` (recovered from `z`) when soft-capped; 0 in padded columns."""
    du = dz * inv_temperature
    if softcap is None:
        return du
    slope = 1.0 - jnp.square(z / (inv_temperature * softcap))
    return jnp.where(z > -jnp.inf, du * slope, 0.0)


def init_stats(block_n: int, dtype) -> Stats:
    zeros = jnp.zeros((block_n, 1), dtype)
    # A finite floor instead of -inf, so that exp(m_old - m_new) is never exp(-inf + inf).
    return Stats(jnp.full((block_n, 1), jnp.finfo(dtype).min, dtype), zeros, zeros, zeros)


def update_stats(
    stats: Stats, z: jax.Array, cols: jax.Array, targets: jax.Array, with_entropy: bool
) -> Stats:
    """Fold one tile of logits into the running log-sum-exp (Milakov and Gimelshein, 2018)."""
    m, s0, s1, zt = stats
    m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
    rescale = jnp.exp(m - m_new)
    shifted = z - m_new
    e = jnp.exp(shifted)  # 0 in -inf columns
    s0_new = rescale * s0 + jnp.sum(e, axis=1, keepdims=True)
    if with_entropy:
        # Moving the reference point from m to m_new adds (m - m_new) to every earlier z - m.
        term = jnp.where(z > -jnp.inf, e * shifted, 0.0)
        s1 = rescale * (s1 + (m - m_new) * s0) + jnp.sum(term, axis=1, keepdims=True)
    zt = zt + jnp.sum(jnp.where(cols == targets, z, 0.0), axis=1, keepdims=True)
    return Stats(m_new, s0_new, s1, zt)


def finish_stats(stats: Stats) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`(logps, entropy, lse, E_p[z])` per token from the final state, each `[N]`."""
    m, s0, s1, zt = (x[:, 0] for x in stats)
    log_s0 = jnp.log(s0)
    lse = m + log_s0
    mean_shift = s1 / s0
    return zt - lse, log_s0 - mean_shift, lse, m + mean_shift


def logits_cotangent(
    z: jax.Array,
    cols: jax.Array,
    targets: jax.Array,
    lse: jax.Array,
    mean_z: jax.Array,
    g: jax.Array,
    e: jax.Array,
    with_entropy: bool,
) -> tuple[jax.Array, jax.Array]:
    """`dz` for one tile and its per-token `sum_v dz_v (z_v - lse)` (for the temperature).

    `dz = g (onehot(y) - p) - e p (z - E_p[z])`, zero in `-inf` columns.
    """
    finite = z > -jnp.inf
    p = jnp.exp(z - lse)
    dz = g * (jnp.where(cols == targets, 1.0, 0.0) - p)
    if with_entropy:
        dz = dz - e * jnp.where(finite, p * (z - mean_z), 0.0)
    dz = jnp.where(finite, dz, 0.0)
    # sum_v dz_v = 0, so shifting z by lse leaves the sum unchanged and keeps it accurate.
    zdz = jnp.sum(jnp.where(finite, dz * (z - lse), 0.0), axis=1, keepdims=True)
    return dz, zdz


def launch(kernel, stage: str, cfg: Config, compiler_params, **call):
    """`pl.pallas_call` of `kernel` with `cfg` bound, named `fused_logps_<stage>`, run by the
    Pallas interpreter when `cfg.interpret`: what both lowerings share. `call` holds the rest
    of `pl.pallas_call`'s arguments (output shapes, grid, block specs, scratch), which differ."""
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg),
        compiler_params=compiler_params,
        interpret=cfg.interpret,
        name=f"fused_logps_{stage}",
        **call,
    )
