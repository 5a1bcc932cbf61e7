r"""Error bounds of float32 computations on each JAX backend, derived from the operands: the
tolerances of the tests that compare an accelerator's results with float64 references (the
accelerator tier, docs/tpu.md). Every bound is elementwise and computed in float64 NumPy.

**Matrix products.** A backend multiplies float32 matrices in passes whose inputs are
rounded first: at JAX's default precision a TPU rounds each float32 operand to bfloat16
(unit roundoff $u_{in} = 2^{-8}$) and sums the exact products in float32; ``"high"`` is three
bfloat16 passes (each operand split in two bfloat16 parts, the cross terms below $2^{-16}$
dropped: $u_{in} = 2^{-16}$), ``"highest"`` six ($2^{-24}$, the float32 operand itself); a GPU at
the default precision rounds to TensorFloat-32 ($2^{-11}$); a CPU multiplies float32 as it is
($u_{in} = 0$). 16-bit operands are multiplied as they are (a product of two fits float32).
With $\tilde a = a (1 + \alpha)$, $\tilde b = b (1 + \beta)$, $|\alpha|, |\beta| \le u_{in}$,
and a float32 sum of $K$ products in any order (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., section 3.1: $|fl(x^\top y) - x^\top y| \le \gamma_K |x|^\top |y|$,
$\gamma_K = K u / (1 - K u)$, $u = 2^{-24}$):

$$
|fl(A B) - A B| \le \big((1 + u_{in})^2 (1 + \gamma_K) - 1\big)\, |A|\,|B| ,
$$

about $2 u_{in} |A||B|$ plus float32's own term; a 16-bit result rounds once more, and an
operand that the device first stores in a narrower dtype than the reference holds (a float64
reference of a float32 array, a cotangent cast to bfloat16) once before. The model was checked
on a TPU v5e (jax 0.10.2): the largest error of random products, relative to $|A||B|$, was
$2.0 \cdot 10^{-3}$ at the default precision ($2 u_{in} = 7.8 \cdot 10^{-3}$),
$1.3 \cdot 10^{-5}$ at ``"high"`` and $9 \cdot 10^{-8}$ at ``"highest"`` (K = 64).

**Elementwise functions.** XLA states no accuracy for `exp`, `log` and `tanh`, and a TPU's
are far from float32's half ulp: on that v5e the largest errors seen (in XLA's programs and in
a Pallas kernel) were $1.1 \cdot 10^{-4}$ for `log` (absolute, on [1, 2^24]),
$4.4 \cdot 10^{-5}$ for `tanh` (absolute) and $6.5 \cdot 10^{-6}$ for `exp` (relative, on
[-80, 0]), against about one ulp on a CPU. So `elementwise_errors` measures them on the
backend under test, over $2^{20}$ arguments spanning the ranges a log-softmax gives them (in
XLA's programs and, on a TPU, in a Pallas kernel too), and keeps twice the largest error
seen: a measurement, the one part of these bounds that is not derived.

**After the logits.** An error of at most $\epsilon$ in each logit of a row moves its
log-sum-exp by at most $\epsilon$ (it is 1-Lipschitz in the max norm), so each log-prob by at
most $2 \epsilon$ and each probability by a factor within $e^{\pm 2 \epsilon}$. The entropy
$H = \mathrm{lse} - E_p z$ moves, along a perturbation $\delta$, at the rate
$-\mathrm{Cov}_p(\delta, z) \le 2 \epsilon\, E_p |z - E_p z|$, and along the segment that mean
absolute deviation is at most $2 (e^{2 \epsilon} D + \epsilon)$ with $D = E_p |z - E_p z|$ of
the exact logits: $|\Delta H| \le 4 \epsilon (e^{2 \epsilon} D + \epsilon)$. The gradients
follow from $\partial z = g (\mathbb{1}_y - p) - e\, p\, (z - E_p z)$ term by term, then
through the backward products. Each step adds the rounding of its own float32 evaluation
(to first order in $u$, with the measured function errors); the sums are summed over at most
`tiles` vocabulary tiles, each merged with one more `exp`.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

U32 = 2.0**-24  # float32's unit roundoff
# The relative rounding of a float32 operand inside a matrix product, per backend and
# precision (see the module docstring).
OPERAND_ROUNDOFF = {
    "tpu": {"default": 2.0**-8, "high": 2.0**-16, "highest": 2.0**-24},
    "gpu": {"default": 2.0**-11, "high": 2.0**-11, "highest": 0.0},
    "cpu": {"default": 0.0, "high": 0.0, "highest": 0.0},
}
_PRECISIONS = {
    "default": "default", "bfloat16": "default", "fastest": "default",
    "high": "high", "tensorfloat32": "high", "bfloat16_3x": "high",
    "highest": "highest", "float32": "highest",
}  # fmt: skip


def backend_name(backend: str | None = None) -> str:
    """The backend as "tpu", "gpu" or "cpu" (JAX's default backend for None)."""
    backend = jax.default_backend() if backend is None else backend
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


def unit_roundoff(dtype) -> float:
    """Half the spacing of `dtype`'s floats at 1: 2^-24 for float32, 2^-8 for bfloat16."""
    return float(jnp.finfo(dtype).eps) / 2


def operand_roundoff(dtype, *, backend: str | None = None, precision=None) -> float:
    """The relative rounding of an operand of `dtype` inside a product on `backend` at
    `precision` (None: JAX's current default, which `jax.default_matmul_precision` sets)."""
    if jnp.dtype(dtype).itemsize <= 2:
        return 0.0
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    if isinstance(precision, jax.lax.Precision):
        precision = precision.name
    name = _PRECISIONS[str(precision or "default").lower()]
    return OPERAND_ROUNDOFF[backend_name(backend)][name]


def matmul_error(
    a, b, *, backend=None, precision=None, a_stored=None, b_stored=None, out_dtype="float32"
) -> np.ndarray:
    """Elementwise bound on |computed - exact| of `a @ b` (see the module docstring).

    `a` and `b` hold exactly the values the device multiplies, unless `a_stored` (`b_stored`)
    names the dtype the device first rounds that operand to (then the operand is the exact
    value, a float64 reference, and that dtype's rounding is added). `out_dtype` is the
    result's dtype; the sum is float32's.
    """

    def roundoff(x, stored):
        if stored is None:
            return operand_roundoff(x.dtype, backend=backend, precision=precision)
        pass_ = operand_roundoff(stored, backend=backend, precision=precision)
        return (1 + unit_roundoff(stored)) * (1 + pass_) - 1

    a, b = np.asarray(a), np.asarray(b)
    k = a.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    rel = (1 + roundoff(a, a_stored)) * (1 + roundoff(b, b_stored)) * (1 + gamma) - 1
    if jnp.dtype(out_dtype).itemsize <= 2:
        rel = (1 + rel) * (1 + unit_roundoff(out_dtype)) - 1
    return rel * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))


# ---- elementwise functions --------------------------------------------------------------------


class Elementwise(NamedTuple):
    """Twice the largest error seen on a backend: `exp` relative on [-80, 0], `log` absolute on
    [1, 2^24] (the log of a sum of exponentials of non-positive numbers, one of them 0), `tanh`
    absolute on [-30, 30]."""

    exp: float
    log: float
    tanh: float


_GRID = 2**20


def _arguments() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    half = _GRID // 2

    def spread(low, high, log=False):
        grid = np.geomspace(low, high, half) if log else np.linspace(low, high, half)
        drawn = (
            np.exp(rng.uniform(np.log(low), np.log(high), half))
            if log
            else rng.uniform(low, high, half)
        )
        return np.concatenate([grid, drawn]).astype(np.float32).reshape(1024, -1)

    return spread(-80.0, 0.0), spread(1.0, 2.0**24, log=True), spread(-30.0, 30.0)


def _functions(e, lg, t):
    return jnp.exp(e), jnp.log(lg), jnp.tanh(t)


def _pallas_functions(e, lg, t):
    """The three functions in a Mosaic kernel: Pallas lowers them itself, not through XLA."""
    from jax.experimental import pallas as pl

    def kernel(e_ref, l_ref, t_ref, eo_ref, lo_ref, to_ref):
        eo_ref[...], lo_ref[...], to_ref[...] = _functions(e_ref[...], l_ref[...], t_ref[...])

    block = pl.BlockSpec((128, e.shape[1]), lambda i: (i, 0))
    shape = jax.ShapeDtypeStruct(e.shape, e.dtype)
    return pl.pallas_call(
        kernel,
        out_shape=[shape] * 3,
        grid=(e.shape[0] // 128,),
        in_specs=[block] * 3,
        out_specs=[block] * 3,
    )(e, lg, t)


@functools.cache
def elementwise_errors(backend: str | None = None) -> Elementwise:
    """`exp`, `log` and `tanh` as `backend` (default: JAX's) computes them, measured against
    float64 NumPy (once per backend and process)."""
    backend = backend_name(backend)
    device = jax.devices(backend)[0]
    args = _arguments()
    exact = [np.exp(args[0].astype(np.float64)), np.log(args[1].astype(np.float64)),
             np.tanh(args[2].astype(np.float64))]  # fmt: skip
    programs = [jax.jit(_functions)]
    if backend == "tpu":
        programs.append(jax.jit(_pallas_functions))
    worst = np.zeros(3)
    on_device = [jax.device_put(x, device) for x in args]
    for program in programs:
        got = [np.asarray(x, np.float64) for x in program(*on_device)]
        errors = (
            np.abs(got[0] - exact[0]) / exact[0],
            np.abs(got[1] - exact[1]),
            np.abs(got[2] - exact[2]),
        )
        worst = np.maximum(worst, [float(np.max(x)) for x in errors])
    floor = (U32, 16.7 * U32, U32)  # at least float32's own rounding (log 2^24 = 16.6)
    return Elementwise(*(max(2 * w, f) for w, f in zip(worst, floor, strict=True)))


# ---- after the logits -------------------------------------------------------------------------


class Softmax(NamedTuple):
    """A row-wise softmax of exact float64 logits `z [N, V]` and what the bounds need of it."""

    z: np.ndarray
    m: np.ndarray  # [N, 1] max
    lse: np.ndarray  # [N, 1]
    logp: np.ndarray  # [N, V]
    p: np.ndarray  # [N, V]
    entropy: np.ndarray  # [N]
    mean_z: np.ndarray  # [N, 1] E_p z


def softmax(z) -> Softmax:
    z = np.asarray(z, np.float64)
    m = z.max(-1, keepdims=True)
    lse = m + np.log(np.exp(z - m).sum(-1, keepdims=True))
    logp = z - lse
    p = np.exp(logp)
    mean_z = (p * z).sum(-1, keepdims=True)
    return Softmax(z, m, lse, logp, p, (lse - mean_z)[:, 0], mean_z)


class SoftmaxErrors(NamedTuple):
    """Bounds on |computed - exact| for logits known to within `logit_error` per element."""

    logp: np.ndarray  # [N, V]
    lse: np.ndarray  # [N, 1]
    entropy: np.ndarray  # [N]
    eps: np.ndarray  # [N, 1] the rows' largest logit error


def softmax_errors(sm: Softmax, logit_error, fe: Elementwise, *, tiles: int) -> SoftmaxErrors:
    """Log-probs, log-sum-exp and entropy computed in float32 from logits within
    `logit_error` of `sm.z`, summed over at most `tiles` vocabulary tiles (module docstring)."""
    z, m, lse, p = sm.z, sm.m, sm.lse, sm.p
    vocab = z.shape[-1]
    eps = np.broadcast_to(np.asarray(logit_error, np.float64), z.shape).max(-1, keepdims=True)
    spread = (p * np.abs(z - m)).sum(-1, keepdims=True)  # E_p |z - m|
    # The sum of exponentials, relative: every exp (and each tile's rescaling exp), the
    # rounding of its argument, and float32's sum of V terms.
    theta = (tiles + 1) * (fe.exp + 2 * U32) + U32 * spread + vocab * U32 / (1 - vocab * U32)
    log_s = lse - m
    lse_eval = fe.log + theta / (1 - theta) + 2 * U32 * (np.abs(m) + np.abs(lse))
    logp_eval = lse_eval + 2 * U32 * (np.abs(z) + np.abs(sm.logp))
    abs_mean = (p * np.abs(z)).sum(-1, keepdims=True)  # E_p |z|
    entropy_eval = (
        lse_eval
        + (theta + fe.exp + 4 * U32) * (abs_mean + spread + log_s)
        + 2 * U32 * (np.abs(lse) + abs_mean + np.abs(sm.entropy[:, None]))
    )
    deviation = (p * np.abs(z - sm.mean_z)).sum(-1, keepdims=True)  # D = E_p |z - E_p z|
    entropy_moved = 4 * eps * (np.exp(2 * eps) * deviation + eps)
    return SoftmaxErrors(
        logp=2 * eps + logp_eval,
        lse=eps + lse_eval,
        entropy=(entropy_moved + entropy_eval)[:, 0],
        eps=eps,
    )


def logits_cotangent_errors(
    sm: Softmax, errors: SoftmaxErrors, targets, g, e, fe: Elementwise
) -> tuple[np.ndarray, np.ndarray]:
    """`dz = g (onehot(y) - p) - e p (z - E_p z)` exactly, and a bound on |computed - exact|
    per element, from the forward pass's bounds: p moves by a factor within
    exp(±(error of log p)) (and exp's own error), z - E_p z by the logit's error plus that of
    E_p z = lse - H."""
    p, z = sm.p, sm.z
    g = np.asarray(g, np.float64)[:, None]
    e = np.asarray(e, np.float64)[:, None]
    onehot = np.zeros_like(z)
    onehot[np.arange(len(z)), np.asarray(targets)] = 1.0
    centred = z - sm.mean_z
    dz = g * (onehot - p) - e * p * centred
    rho = np.exp(errors.logp) * (1 + fe.exp) - 1  # |p~ - p| <= rho p
    kappa = errors.eps + errors.lse + errors.entropy[:, None]  # |(z - E_p z)~ - (z - E_p z)|
    moved = np.abs(g) * rho * p + np.abs(e) * (rho * p * (np.abs(centred) + kappa) + p * kappa)
    # Its own float32 evaluation, in any arrangement of the terms (autodiff forms p z and
    # p E_p z apart).
    magnitude = np.abs(centred) + np.abs(z) + np.abs(sm.mean_z)
    rounding = 4 * U32 * (np.abs(g) * (onehot + p) + np.abs(e) * p * magnitude)
    return dz, moved + rounding


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- the fused log-prob head ------------------------------------------------------------------

# The narrowest vocabulary tile any implementation uses (the kernels' 64-column fallback; the
# chunked path's chunks are at least 128): the most rescaled partial sums a row can have.
NARROWEST_TILE = 64


class Head(NamedTuple):
    """Exact (float64) values of the fused head and bounds on a computation's errors."""

    logps: np.ndarray
    entropy: np.ndarray
    dh: np.ndarray
    dw: np.ndarray
    logps_error: np.ndarray
    entropy_error: np.ndarray
    dh_error: np.ndarray
    dw_error: np.ndarray


def fused_head(
    h,
    w,
    b,
    targets,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    g=None,
    e=None,
    backend: str | None = None,
    precision=None,
    cotangent_dtype=None,
) -> Head:
    """The head `logps, entropy = f(h, w, b)` with `z = cap(h w + b) / temperature` (`cap(u) =
    c tanh(u / c)` for `softcap` c), the gradients of `sum(g logps + e entropy)` with
    respect to `h` and `w`, and bounds on how far a computation on `backend` at `precision`
    (None: JAX's current default) can be from them.

    `h [N, H]`, `w [H, V]` and `b [V]` are the arrays as the device holds them (float32 or
    bfloat16; `b` may be None). `cotangent_dtype` is the dtype `dz` is rounded to before the
    backward products (the kernels cast it to the inputs' dtype; None: float32); the gradients
    are rounded to `h`'s and `w`'s dtypes.
    """
    fe = elementwise_errors(backend)
    h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
    n, vocab = h64.shape[0], w64.shape[1]
    bias = np.zeros(vocab) if b is None else np.asarray(b, np.float64)
    g = np.ones(n) if g is None else np.asarray(g, np.float64)
    e = np.zeros(n) if e is None else np.asarray(e, np.float64)
    tau = float(temperature)

    u = h64 @ w64 + bias
    u_error = matmul_error(h, w, backend=backend, precision=precision) + U32 * np.abs(u)
    if softcap is None:
        capped, capped_error = u, u_error
    else:  # c tanh(u / c): tanh is 1-Lipschitz; its argument, itself and the product round
        capped = softcap * np.tanh(u / softcap)
        capped_error = u_error + softcap * fe.tanh + U32 * (np.abs(u) + np.abs(capped))
    z = capped / tau
    z_error = capped_error / tau + 2 * U32 * np.abs(z)  # 1 / tau and the product round

    sm = softmax(z)
    errors = softmax_errors(sm, z_error, fe, tiles=ceil_div(vocab, NARROWEST_TILE) + 1)
    rows = np.arange(n)
    dz, dz_error = logits_cotangent_errors(sm, errors, targets, g, e, fe)
    if softcap is None:
        slope, slope_error = 1.0, 0.0
    else:  # 1 - t^2 with t = tanh(u / c), recovered from z as z tau / c
        t = capped / softcap
        t_error = tau * z_error / softcap + 2 * U32 * np.abs(t)
        slope = 1 - t**2
        slope_error = 2 * np.abs(t) * t_error + t_error**2 + U32
    du = dz * slope / tau
    du_error = (dz_error * slope + np.abs(dz) * slope_error) / tau + 3 * U32 * np.abs(du)

    # d h = du w^T and d w = h^T du: du's error carried through |w| and |h|, plus the
    # products' own rounding with du rounded to `cotangent_dtype` first.
    stored = jnp.dtype(cotangent_dtype or "float32")
    h_device, w_device = np.asarray(h), np.asarray(w)
    dh = du @ w64.T
    dh_error = du_error @ np.abs(w64.T) + matmul_error(
        du, w_device.T, backend=backend, precision=precision, a_stored=stored,
        out_dtype=h_device.dtype,
    )  # fmt: skip
    dw = h64.T @ du
    dw_error = np.abs(h64.T) @ du_error + matmul_error(
        h_device.T, du, backend=backend, precision=precision, b_stored=stored,
        out_dtype=w_device.dtype,
    )  # fmt: skip
    return Head(
        logps=sm.logp[rows, targets],
        entropy=sm.entropy,
        dh=dh,
        dw=dw,
        logps_error=errors.logp[rows, targets],
        entropy_error=errors.entropy,
        dh_error=dh_error,
        dw_error=dw_error,
    )


def assert_within(got, exact, bound, *, what: str = "") -> None:
    """Every entry of `got` within its `bound` of `exact` (float64), with the worst ratio of
    error to bound in the message."""
    got64 = np.asarray(got, np.float64)
    exact = np.broadcast_to(np.asarray(exact, np.float64), got64.shape)
    bound = np.broadcast_to(np.asarray(bound, np.float64), got64.shape)
    error = np.abs(got64 - exact)
    assert np.all(np.isfinite(got64)), f"{what}: non-finite values"
    ratio = error / np.maximum(bound, np.finfo(np.float64).tiny)
    worst = np.unravel_index(np.argmax(ratio), ratio.shape)
    assert np.all(error <= bound), (
        f"{what}: error {error[worst]:.3g} > bound {bound[worst]:.3g} at {worst} "
        f"({int(np.sum(error > bound))} of {error.size} entries over)"
    )


def sum_error(terms, axis=None) -> np.ndarray:
    """float32's rounding of a sum of `terms` in any order: gamma_K sum |terms|."""
    terms = np.abs(np.asarray(terms, np.float64))
    k = terms.size if axis is None else terms.shape[axis]
    return k * U32 / (1 - k * U32) * terms.sum(axis=axis)
