r"""The gated delta rule of Gated DeltaNet layers, in its recurrent and chunked forms, and the
pieces around it: the short causal convolution and the gated RMSNorm.

With per-head state $S_t \in \mathbb{R}^{d_v \times d_k}$, decay $\alpha_t = e^{g_t}$ and
writing strength $\beta_t$ (Yang et al., 2024, eq. 10):

$$
S_t = \alpha_t\, S_{t-1} \big(I - \beta_t k_t k_t^\top\big) + \beta_t v_t k_t^\top,
\qquad o_t = S_t q_t .
$$

The state is stored transposed, `[..., d_k, d_v]`, as Hugging Face and the FLA kernels store
it. `recurrent_gated_delta_rule` runs the recurrence one token at a time (decoding);
`chunked_gated_delta_rule` computes the same outputs and final state with matrix products
over chunks of $C$ tokens (training and prefill).
"""

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as checks


def _checked(q, k, values, g, beta, state):
    """The inputs as arrays of at least float32 (the dtype the rule runs in), shapes checked."""
    q, k, values, g, beta = (
        checks.float_array(x, name)
        for x, name in ((q, "q"), (k, "k"), (values, "v"), (g, "g"), (beta, "beta"))
    )
    high = checks.compute_dtype(q.dtype)
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must have one shape [B, T, H, Dk], got {q.shape}, {k.shape}.")
    b, t, h, dk = q.shape
    if values.ndim != 4 or values.shape[:3] != (b, t, h):
        raise ValueError(f"v must have shape [{b}, {t}, {h}, Dv], got {values.shape}.")
    for x, name in ((g, "g"), (beta, "beta")):
        checks.check_shape(x, name, (b, t, h), f"q {q.shape}")
    dv = values.shape[-1]
    if state is None:
        state = jnp.zeros((b, h, dk, dv), high)
    else:
        state = checks.float_array(state, "state")
        checks.check_shape(state, "state", (b, h, dk, dv), f"q {q.shape} and v {values.shape}")
    return tuple(x.astype(high) for x in (q, k, values, g, beta, state))


def recurrent_gated_delta_rule(
    q: Float[ArrayLike, "B T H Dk"],
    k: Float[ArrayLike, "B T H Dk"],
    v: Float[ArrayLike, "B T H Dv"],
    g: Float[ArrayLike, "B T H"],
    beta: Float[ArrayLike, "B T H"],
    state: Float[ArrayLike, "B H Dk Dv"] | None = None,
) -> tuple[Float[Array, "B T H Dv"], Float[Array, "B H Dk Dv"]]:
    r"""The gated delta rule one token at a time: outputs and the final state.

    $S_t = e^{g_t} S_{t-1} (I - \beta_t k_t k_t^\top) + \beta_t v_t k_t^\top$,
    $o_t = S_t q_t$ (module docstring), with $q$ = `q`, $k$ = `k`, $v$ = `v`, $g$ = `g`
    (log decay, $\le 0$), $\beta$ = `beta` and $S_0$ = `state` (zero when None). Queries and
    keys are used as given (Gated DeltaNet L2-normalises them and scales the queries by
    $d_k^{-1/2}$ first: `GatedDeltaNet`).

    Args:
      q: `[B, T, H, Dk]` queries.
      k: `[B, T, H, Dk]` keys.
      v: `[B, T, H, Dv]` values.
      g: `[B, T, H]` log decays.
      beta: `[B, T, H]` writing strengths.
      state: `[B, H, Dk, Dv]` state before the first token (the transpose of $S$); None
        means zeros.

    Returns:
      The `[B, T, H, Dv]` outputs and the `[B, H, Dk, Dv]` state after the last token, in
      at least float32.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.models import recurrent_gated_delta_rule
      >>> k = jnp.array([[[[1.0, 0.0]], [[1.0, 0.0]]]])  # one row, 2 tokens, 1 head
      >>> v = jnp.array([[[[2.0]], [[6.0]]]])
      >>> g, beta = jnp.zeros((1, 2, 1)), jnp.full((1, 2, 1), 0.5)
      >>> out, state = recurrent_gated_delta_rule(k, k, v, g, beta)
      >>> print(out[0, :, 0, 0], state[0, 0, :, 0])  # 0.5 * 2, then 1 + 0.5 * (6 - 1)
      [1.  3.5] [3.5 0. ]

    References:
      Yang, Kautz and Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule",
      2024, https://arxiv.org/abs/2412.06464.
    """
    q, k, v, g, beta, state = _checked(q, k, v, g, beta, state)

    def step(s, xs):
        q_t, k_t, v_t, g_t, beta_t = xs
        s = s * jnp.exp(g_t)[..., None, None]
        predicted = jnp.einsum("bhk,bhkv->bhv", k_t, s)
        delta = (v_t - predicted) * beta_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhk,bhkv->bhv", q_t, s)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


def unit_lower_inverse(a: Float[ArrayLike, "*B C C"]) -> Float[Array, "*B C C"]:
    r"""The inverse of unit lower-triangular matrices, by doubling blocks: matrix products only.

    With $L = \begin{pmatrix} L_{11} & 0 \\ L_{21} & L_{22} \end{pmatrix}$,
    $L^{-1} = \begin{pmatrix} L_{11}^{-1} & 0 \\ -L_{22}^{-1} L_{21} L_{11}^{-1} &
    L_{22}^{-1} \end{pmatrix}$; starting from the $1 \times 1$ blocks (ones), each of
    $\lceil \log_2 C \rceil$ rounds inverts the diagonal blocks of twice the size from
    the last round's. The entries above the diagonal and on it are not read (taken as 0
    and 1); $C$ is padded with the identity to a power of two.

    This replaces a batched `jax.scipy.linalg.solve_triangular`: on CPU, jaxlib 0.10's
    LAPACK triangular solve splits its batch over XLA's thread pool and waits on it from a
    thread of that pool, so two solves running at once on a 2-thread pool wait on each
    other for ever. Matrix products have no such wait, and are what an accelerator runs
    fastest. Its accuracy is the solve's: in float32, over 512 tokens of unit keys in chunks
    of 64, the chunked rule's outputs lay within 1.5e-7 of a float64 recurrence with it and
    1.6e-7 with the solve (2.7e-7 both with log decays down to -1).

    Args:
      a: `[..., C, C]` unit lower-triangular matrices.

    Returns:
      Their `[..., C, C]` inverses, in the dtype of `a`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.models import unit_lower_inverse
      >>> a = jnp.array([[1.0, 0.0, 0.0], [2.0, 1.0, 0.0], [3.0, 4.0, 1.0]])
      >>> print(unit_lower_inverse(a))
      [[ 1.  0.  0.]
       [-2.  1.  0.]
       [ 5. -4.  1.]]
    """
    a = jnp.asarray(a)
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"a must be [..., C, C] square matrices, got shape {a.shape}.")
    c = a.shape[-1]
    n = 1 << max(c - 1, 0).bit_length()
    a = jnp.tril(a, -1)
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, n - c), (0, n - c)])
    batch = a.shape[:-2]
    inverse = jnp.ones((*batch, n, 1, 1), a.dtype)  # the inverses of the diagonal blocks
    size = 1
    while size < n:
        blocks = n // (2 * size)
        tiles = a.reshape(*batch, blocks, 2 * size, blocks, 2 * size)
        diagonal = jnp.moveaxis(jnp.diagonal(tiles, axis1=-4, axis2=-2), -1, -3)
        lower = diagonal[..., size:, :size]  # L21 of each pair, [..., blocks, size, size]
        first, second = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        corner = -(second @ lower @ first)
        top = jnp.concatenate([first, jnp.zeros_like(first)], axis=-1)
        bottom = jnp.concatenate([corner, second], axis=-1)
        inverse = jnp.concatenate([top, bottom], axis=-2)
        size *= 2
    return inverse[..., 0, :c, :c]


def chunked_gated_delta_rule(
    q: Float[ArrayLike, "B T H Dk"],
    k: Float[ArrayLike, "B T H Dk"],
    v: Float[ArrayLike, "B T H Dv"],
    g: Float[ArrayLike, "B T H"],
    beta: Float[ArrayLike, "B T H"],
    state: Float[ArrayLike, "B H Dk Dv"] | None = None,
    *,
    chunk_size: int = 64,
) -> tuple[Float[Array, "B T H Dv"], Float[Array, "B H Dk Dv"]]:
    r"""The gated delta rule over chunks of `chunk_size` tokens: what
    `recurrent_gated_delta_rule` computes, with matrix products.

    Within a chunk, with $\gamma_i = \sum_{j \le i} g_j$ (from the chunk's start) and
    $\Gamma_{ij} = e^{\gamma_i - \gamma_j}$ for $j \le i$ (0 above), the chunk's
    $C$ updates unroll into the WY form: $(I + A)\,U = \mathrm{diag}(\beta) V$ and
    $(I + A)\,W = \mathrm{diag}(\beta e^{\gamma}) K$ with $A$ the strictly lower part of
    $\mathrm{diag}(\beta) K K^\top \odot \Gamma$ (one unit-triangular inverse,
    `unit_lower_inverse`, applied to both). With the
    state $S$ (transposed) before the chunk, $\tilde U = U - W S$ are the values the chunk
    writes, its outputs are $\mathrm{diag}(e^{\gamma}) Q S + (Q K^\top \odot \Gamma)\tilde U$
    and the state after it is $e^{\gamma_C} S + (\mathrm{diag}(e^{\gamma_C - \gamma}) K)^\top
    \tilde U$. The chunks run in order (`lax.scan`); the last is padded with tokens of zero
    key, value and log decay, which change nothing.

    Args:
      q: `[B, T, H, Dk]` queries, as `recurrent_gated_delta_rule`.
      k: `[B, T, H, Dk]` keys.
      v: `[B, T, H, Dv]` values.
      g: `[B, T, H]` log decays.
      beta: `[B, T, H]` writing strengths.
      state: `[B, H, Dk, Dv]` state before the first token (None: zeros).
      chunk_size: $C$ (static), tokens per chunk (Hugging Face and FLA: 64).

    Returns:
      The `[B, T, H, Dv]` outputs and the `[B, H, Dk, Dv]` final state, as
      `recurrent_gated_delta_rule` (equal up to float32 rounding).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from tunelib.models import chunked_gated_delta_rule, recurrent_gated_delta_rule
      >>> keys = jax.random.split(jax.random.key(0), 5)
      >>> q, k = (jax.random.normal(x, (1, 10, 2, 4)) / 2 for x in keys[:2])
      >>> v = jax.random.normal(keys[2], (1, 10, 2, 3))
      >>> g = -jax.random.uniform(keys[3], (1, 10, 2))
      >>> beta = jax.random.uniform(keys[4], (1, 10, 2))
      >>> chunked, s1 = chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=4)
      >>> recurrent, s2 = recurrent_gated_delta_rule(q, k, v, g, beta)
      >>> print(bool(jnp.allclose(chunked, recurrent, atol=1e-5)),
      ...       bool(jnp.allclose(s1, s2, atol=1e-5)))
      True True

    References:
      Yang, Kautz and Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule",
      2024, https://arxiv.org/abs/2412.06464 (section 3.3, the chunkwise form).
      Yang et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence
      Length", 2024, https://arxiv.org/abs/2406.06484 (the WY representation).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}.")
    q, k, v, g, beta, state = _checked(q, k, v, g, beta, state)
    t, c = q.shape[1], chunk_size
    pad = (-t) % c

    def chunks(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return rearrange(x, "b (n c) h ... -> n b h c ...", c=c)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    gamma = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
    lower = jnp.tril(jnp.ones((c, c), jnp.bool_))
    gaps = jnp.where(lower, gamma[..., :, None] - gamma[..., None, :], 0.0)
    decay = jnp.where(lower, jnp.exp(gaps), 0.0)  # Gamma, [N, B, H, C, C]
    k_beta = k * beta[..., None]
    strictly = jnp.tril(jnp.ones((c, c), jnp.bool_), -1)
    system = jnp.eye(c, dtype=q.dtype) + jnp.where(
        strictly, jnp.einsum("...ik,...jk->...ij", k_beta, k) * decay, 0.0
    )

    inverse = unit_lower_inverse(system)
    u = inverse @ (v * beta[..., None])
    w = inverse @ (k_beta * jnp.exp(gamma)[..., None])
    attention = jnp.einsum("...ik,...jk->...ij", q, k) * decay
    q_decayed = q * jnp.exp(gamma)[..., None]
    k_decayed = k * jnp.exp(gamma[..., -1:] - gamma)[..., None]
    chunk_decay = jnp.exp(gamma[..., -1])[..., None, None]

    def step(s, xs):
        u, w, q_decayed, attention, k_decayed, chunk_decay = xs
        written = u - w @ s
        out = q_decayed @ s + attention @ written
        s = s * chunk_decay + jnp.swapaxes(k_decayed, -1, -2) @ written
        return s, out

    xs = (u, w, q_decayed, attention, k_decayed, chunk_decay)
    state, out = jax.lax.scan(step, state, xs)
    return rearrange(out, "n b h c d -> b (n c) h d")[:, :t], state


def causal_conv1d(
    x: Float[ArrayLike, "B T C"],
    weight: Float[ArrayLike, "C K"],
    state: Float[ArrayLike, "B K1 C"] | None = None,
) -> tuple[Float[Array, "B T C"], Float[Array, "B K1 C"]]:
    r"""A depthwise causal convolution of `K` taps over time, and its state.

    $y_{t,c} = \sum_{j=0}^{K-1} w_{c,j}\, x_{t - K + 1 + j,\, c}$, where the $K - 1$ inputs
    before the first are `state` (zeros when None): PyTorch's `Conv1d(groups=C,
    padding=K-1)` cut to the first $T$ outputs, as Gated DeltaNet's short convolution.

    Args:
      x: `[B, T, C]` inputs.
      weight: `[C, K]` taps, the oldest input's first.
      state: `[B, K - 1, C]` the inputs before `x` (oldest first); None means zeros.

    Returns:
      The `[B, T, C]` outputs and the `[B, K - 1, C]` state after `x` (its last $K - 1$
      inputs, with the state's in front when $T < K - 1$), in the dtype of `x`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.models import causal_conv1d
      >>> x = jnp.array([[[1.0], [2.0], [3.0]]])
      >>> y, state = causal_conv1d(x, jnp.array([[1.0, 10.0]]))
      >>> print(y[0, :, 0], state[0, :, 0])  # 10 x_t + x_{t-1}
      [10. 21. 32.] [3.]
    """
    x = checks.float_array(x, "x")
    weight = checks.float_array(weight, "weight")
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"x must be [B, T, C] and weight [C, K], got {x.shape} and {weight.shape}."
        )
    taps = weight.shape[1]
    if state is None:
        state = jnp.zeros((x.shape[0], taps - 1, x.shape[2]), x.dtype)
    else:
        state = checks.float_array(state, "state")
        checks.check_shape(state, "state", (x.shape[0], taps - 1, x.shape[2]), f"x {x.shape}")
    full = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    t = x.shape[1]
    y = sum(full[:, j : j + t] * weight[:, j].astype(x.dtype) for j in range(taps))
    return y, full[:, full.shape[1] - (taps - 1) :]


def gated_rms_norm(
    x: Float[ArrayLike, "*B D"],
    gate: Float[ArrayLike, "*B D"],
    scale: Float[ArrayLike, " D"],
    *,
    eps: float = 1e-6,
) -> Float[Array, "*B D"]:
    r"""RMSNorm of `x` gated by `gate`: $g \odot \hat x \odot \mathrm{silu}(z)$.

    $\hat x = x / \sqrt{\mathrm{mean}(x^2) + \epsilon}$ in at least float32, cast to the
    dtype of `x` before the scale $g$ = `scale` multiplies it; $z$ = `gate` enters the SiLU in
    float32; the result has the dtype of `x` (Hugging Face's `Qwen3_5RMSNormGated`).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.models import gated_rms_norm
      >>> out = gated_rms_norm(jnp.array([3.0, -3.0]), jnp.array([0.0, 20.0]), jnp.ones(2))
      >>> print(out.round(4))  # silu(0) = 0, silu(20) = 20
      [  0. -20.]
    """
    x, gate, scale = (
        checks.float_array(a, n) for a, n in ((x, "x"), (gate, "gate"), (scale, "scale"))
    )
    high = x.astype(checks.compute_dtype(x.dtype))
    normed = high * jax.lax.rsqrt(jnp.mean(high * high, axis=-1, keepdims=True) + eps)
    scaled = scale.astype(x.dtype) * normed.astype(x.dtype)
    gated = scaled * jax.nn.silu(gate.astype(high.dtype))
    return gated.astype(x.dtype)
