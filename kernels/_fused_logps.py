r"""Per-token log-probs from hidden states as Pallas kernels: the fused head on GPU and TPU.

The public function checks and pads its inputs, then runs a `jax.custom_vjp` whose forward
and backward passes are Pallas kernels: `_fused_gpu` (Triton lowering) or `_fused_tpu` (Mosaic
lowering), both built from the tile arithmetic in `_fused_tiles`.
"""

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.kernels import _fused_gpu, _fused_tiles, _fused_tpu

Platform = Literal["gpu", "tpu"]

_KERNELS = {"gpu": _fused_gpu, "tpu": _fused_tpu}
# Preferred blocks per platform, and the smallest legal ones. Where the preferred block does
# not divide V (or H), a smaller one that does is used instead of padding, because padding
# copies the unembedding.
# On a TPU v5e (Gemma-2-2B head, N 8192, H 2304, bf16, value and both gradients) 256 x 512
# blocks took 268 ms against 458 ms at 128 x 128, at the same memory (benchmarks/README.md);
# wider ones (512 x 1024: 255 ms) compile for seconds longer and need more VMEM as H grows.
_DEFAULTS = {"gpu": {"n": 64, "v": 128, "h": 64}, "tpu": {"n": 256, "v": 512}}
_SMALLEST = {"gpu": {"n": 16, "v": 16, "h": 16}, "tpu": {"n": 8, "v": 128}}


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _fit(size: int, preferred: int, smallest: int) -> int:
    """The largest of preferred, preferred / 2, ..., smallest that divides `size`; else
    `preferred` (the array is then padded)."""
    block = preferred
    while block >= smallest:
        if size % block == 0:
            return block
        block //= 2
    return preferred


def _check_block(block: int, name: str, platform: str) -> None:
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"{name} must be a positive int, got {block!r}.")
    if platform == "gpu" and (block < 16 or block & (block - 1)):
        raise ValueError(
            f"{name} must be a power of two >= 16 for the GPU (Triton) kernels, got {block}."
        )
    if platform == "tpu":
        unit = _SMALLEST["tpu"]["n" if name == "block_n" else "v"]
        if block % unit:
            raise ValueError(
                f"{name} must be a multiple of {unit} for the TPU kernels, got {block}."
            )


def _platform(platform: str | None, interpret: bool) -> str:
    backend = jax.default_backend()
    native = "tpu" if backend == "tpu" else "gpu"
    if platform is None:
        platform = native
    v.one_of(platform, "platform", tuple(_KERNELS))
    if not interpret and (backend == "cpu" or platform != native):
        raise ValueError(
            f"platform={platform!r} kernels cannot run on the {backend} backend; pass "
            "interpret=True to run them in the Pallas interpreter."
        )
    return platform


def _config(
    n: int,
    hidden: int,
    vocab: int,
    block_n: int | None,
    block_v: int | None,
    block_h: int | None,
    platform: str,
    with_entropy: bool,
    interpret: bool,
    softcap: float | None = None,
) -> _fused_tiles.Config:
    defaults, smallest = _DEFAULTS[platform], _SMALLEST[platform]
    if platform == "tpu" and block_h is not None:
        raise ValueError("block_h applies to the GPU kernels only; a TPU block holds all of H.")
    if block_n is None:
        unit = smallest["n"]
        fitted = 1 << max(n - 1, 0).bit_length() if platform == "gpu" else _round_up(n, unit)
        block_n = min(defaults["n"], max(fitted, unit))
    if block_v is None:  # at most halved: narrower tiles cost more than the copy saves
        preferred = min(defaults["v"], _round_up(vocab, smallest["v"]))  # no wider than V
        block_v = _fit(vocab, preferred, max(smallest["v"], preferred // 2))
    if block_h is None:
        block_h = _fit(hidden, defaults["h"], smallest["h"]) if platform == "gpu" else hidden
    _check_block(block_n, "block_n", platform)
    _check_block(block_v, "block_v", platform)
    if platform == "gpu":
        _check_block(block_h, "block_h", platform)
    return _fused_tiles.Config(
        platform, block_n, block_v, block_h, vocab, with_entropy, interpret, softcap
    )


def _pad(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if x.shape == shape:
        return x
    return jnp.pad(x, [(0, want - have) for have, want in zip(x.shape, shape, strict=True)])


def _column(x: jax.Array, dtype) -> jax.Array:
    return x.astype(dtype)[:, None]


def _forward(cfg, h, w, b, temperature, y):
    inv_t = (1 / temperature).reshape(1, 1)
    stats = _KERNELS[cfg.platform].forward(h, w, b, inv_t, y, cfg)
    return _fused_tiles.finish_stats(stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(cfg, h, w, b, temperature, y):
    logps, entropy, _, _ = _forward(cfg, h, w, b, temperature, y)
    return (logps, entropy) if cfg.with_entropy else logps


def _fused_fwd(cfg, h, w, b, temperature, y):
    logps, entropy, lse, mean_z = _forward(cfg, h, w, b, temperature, y)
    out = (logps, entropy) if cfg.with_entropy else logps
    return out, (h, w, b, temperature, y, lse, mean_z)


def _fused_bwd(cfg, residuals, cotangents):
    h, w, b, temperature, y, lse, mean_z = residuals
    dtype = lse.dtype
    g, e = cotangents if cfg.with_entropy else (cotangents, jnp.zeros_like(cotangents))
    inv_t = (1 / temperature).reshape(1, 1)
    per_token = [_column(x, dtype) for x in (lse, mean_z, g, e)]
    kernels = _KERNELS[cfg.platform]
    dh, zdz = kernels.hidden_grad(h, w, b, inv_t, y, *per_token, cfg)
    dw, db = kernels.unembedding_grad(h, w, b, inv_t, y, *per_token, cfg)
    # z = u / tau with u = h W + b, so d/dtau = sum_nv dz (-z / tau).
    d_temperature = -jnp.sum(zdz) / temperature
    return dh.astype(h.dtype), dw.astype(w.dtype), db.astype(b.dtype), d_temperature, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_token_logps_pallas(
    hidden: Float[ArrayLike, "N H"],
    unembedding: Float[ArrayLike, "H V"],
    targets: Int[ArrayLike, " N"],
    *,
    bias: Float[ArrayLike, " V"] | None = None,
    temperature: Scalar = 1.0,
    softcap: float | None = None,
    with_entropy: bool = False,
    where: Mask[ArrayLike, " N"] | None = None,
    block_n: int | None = None,
    block_v: int | None = None,
    block_h: int | None = None,
    platform: Platform | None = None,
    interpret: bool = False,
) -> Float[Array, " N"] | tuple[Float[Array, " N"], Float[Array, " N"]]:
    r"""Target log-probs (and entropy) from hidden states by Pallas kernels, no `[N, V]` logits.

    $$
    z_{n} = \mathrm{cap}(h_n W + b) / \tau, \qquad
    \log \pi(y_n) = z_{n, y_n} - \log \sum_v e^{z_{n,v}}, \qquad
    H_n = \log \sum_v e^{z_{n,v}} - \sum_v \pi_{n,v} z_{n,v}
    $$

    with hidden states $h$ = `hidden`, unembedding $W$ = `unembedding`, bias $b$ = `bias`,
    targets $y$ = `targets`, temperature $\tau$ = `temperature` and $\mathrm{cap}(u) =
    c \tanh(u / c)$ for `softcap` $c$ (the identity for None): the values of
    `tunelib.logprobs.fused_token_logps` on 2-D inputs, which calls this function for
    ``implementation="pallas"``.

    The forward kernel runs over blocks of `block_n` tokens and streams the vocabulary in tiles
    of `block_v` columns with an online log-sum-exp (running maximum and rescaled sums), picking
    up the target logit in the tile that holds it. The custom VJP saves only the inputs and two
    numbers per token (the log-sum-exp and $E_\pi[z]$); two backward kernels recompute each
    tile of logits, form

    $$
    \partial z_{n,v} = g_n (\mathbb{1}[v = y_n] - \pi_{n,v})
    - e_n \pi_{n,v} (z_{n,v} - E_\pi[z_n])
    $$

    from the per-token cotangents $g$ (log-probs) and $e$ (entropy), and accumulate
    $\partial h = (\partial z / \tau) W^\top$ over vocabulary tiles and
    $\partial W = h^\top (\partial z / \tau)$, $\partial b = \sum_n \partial z / \tau$ over
    token blocks: $10 N H V$ flops in all (each backward kernel recomputes the logits), no
    atomics, and results that do not depend on scheduling. Matmuls take the inputs' dtype
    (bf16 stays bf16 on the matrix units; 32-bit inputs use full precision) and accumulate in
    float32; $\partial z$ is cast to the inputs' dtype for the backward matmuls. A traced
    `temperature` gets its exact gradient, $-\sum_{n,v} \partial z_{n,v} z_{n,v} / \tau$.

    Shapes that are not multiples of the blocks are padded inside (padded vocabulary columns
    get $-\infty$ logits, padded tokens a zero cotangent) and the outputs sliced back; default
    blocks are chosen to divide $V$ and $H$ where possible, because padding $V$ or $H$ copies
    the unembedding.

    Args:
      hidden: `[N, H]` hidden states, any float dtype.
      unembedding: `[H, V]` unembedding matrix.
      targets: `[N]` integer token ids in `[0, V)`. An id outside that range at a counted
        position is a `ValueError` when the ids can be read (outside `jax.jit`); under `jit`
        the position's log-prob is NaN (its entropy is still computed).
      bias: optional `[V]` bias.
      temperature: $\tau > 0$; may be traced.
      softcap: $c > 0$, the final-logit soft-cap (static), or None. The backward kernels
        multiply each tile's $\partial z / \tau$ by the cap's slope $1 - \tanh^2(u / c)$.
      with_entropy: also return the per-token entropy $H_n$ (static).
      where: `[N]` mask, True (or 1) = counts; masked positions give 0 and send exactly 0
        gradient, even when their hidden states are NaN and their targets out of range.
      block_n: tokens per block (static). Default: 64 on GPU (a power of two >= 16), 128 on
        TPU (a multiple of 8), smaller when N is.
      block_v: vocabulary columns per tile (static). Default: 128 on GPU (a power of two
        >= 16; 64 if that divides V and 128 does not), 128 on TPU (a multiple of 128).
      block_h: GPU only: hidden-dimension chunk of each matmul (a power of two >= 16; default
        64, halved while that divides H). A TPU block holds all of H, so this must stay None.
      platform: which lowering's kernels to build, ``"gpu"`` (Triton) or ``"tpu"`` (Mosaic);
        None picks the default backend's (``"gpu"`` on CPU). Either runs on CPU with
        `interpret=True`.
      interpret: run the kernels in the Pallas interpreter (any backend, slow): how they are
        tested on CPU.

    Returns:
      `[N]` log-probs, float32 (float64 for float64 inputs); with `with_entropy`, the pair
      `(logps, entropy)`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.kernels import fused_token_logps_pallas
      >>> hidden = jnp.array([[1.0, 0.0], [0.0, 1.0]])
      >>> unembedding = jnp.array([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # logits [2, 0, 0], 0
      >>> logps, entropy = fused_token_logps_pallas(
      ...     hidden, unembedding, jnp.array([0, 2]), with_entropy=True, interpret=True
      ... )
      >>> print(logps.round(4), entropy.round(4))
      [-0.2395 -1.0986] [0.6656 1.0986]

    References:
      Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024,
      https://arxiv.org/abs/2411.09009.
      Milakov and Gimelshein, "Online normalizer calculation for softmax", 2018,
      https://arxiv.org/abs/1805.02867.
      Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness",
      2022, https://arxiv.org/abs/2205.14135 (tiling with recomputation in the backward pass).
    """
    hidden = v.float_array(hidden, "hidden")
    if hidden.ndim != 2:
        raise ValueError(f"hidden must have shape [N, H], got {tuple(hidden.shape)}.")
    n, size_h = hidden.shape
    unembedding = v.float_array(unembedding, "unembedding")
    if unembedding.ndim != 2 or unembedding.shape[0] != size_h:
        raise ValueError(
            f"unembedding must have shape [H, V] with H = {size_h} (hidden's last axis), got "
            f"{tuple(unembedding.shape)}."
        )
    vocab = unembedding.shape[1]
    targets = v.int_array(targets, "targets")
    v.check_shape(targets, "targets", (n,), f"hidden {tuple(hidden.shape)} without H")
    if bias is not None:
        bias = v.float_array(bias, "bias")
        v.check_shape(bias, "bias", (vocab,), f"unembedding {tuple(unembedding.shape)}")
    v.positive_scalar(temperature, "temperature")
    where = v.mask_array(where, (n,))
    targets, inside = v.token_id_array(targets, vocab, where)
    platform = _platform(platform, interpret)
    softcap = v.softcap(softcap)
    cfg = _config(
        n, size_h, vocab, block_n, block_v, block_h, platform, with_entropy, interpret, softcap
    )

    dtype = v.compute_dtype(hidden.dtype, unembedding.dtype)
    operand = jnp.promote_types(hidden.dtype, unembedding.dtype)
    # At least one block of tokens, so that N = 0 still runs a (padded) grid.
    n_pad, v_pad = _round_up(max(n, 1), cfg.block_n), _round_up(vocab, cfg.block_v)
    h_pad = _round_up(size_h, cfg.block_h)
    h = _pad(jnp.where(where[:, None], hidden, 0).astype(operand), (n_pad, h_pad))
    w = _pad(unembedding.astype(operand), (h_pad, v_pad))
    b = jnp.zeros((vocab,), dtype) if bias is None else bias.astype(dtype)
    b = _pad(b[None, :], (1, v_pad))
    y = _pad(targets.astype(jnp.int32)[:, None], (n_pad, 1))
    tau = jnp.asarray(temperature, dtype)

    out = _fused(cfg, h, w, b, tau, y)
    logps, entropy = out if with_entropy else (out, None)
    logps = jnp.where(where, jnp.where(inside, logps[:n], jnp.nan), 0.0)
    if not with_entropy:
        return logps
    return logps, jnp.where(where, entropy[:n], 0.0)
