r"""Logits processors for sampling: temperature, top-k, top-p (nucleus), min-p, forbidden tokens.

Each processor maps `[B, V]` logits to `[B, V]` logits in which every excluded token is `-inf`;
sampling from `softmax` of the result keeps the relative probabilities of the kept tokens. They
compose, and `process_logits` applies them in one fixed order. Shared conventions:

* Numerics run in float32 (float64 for float64 input) whatever the input dtype, and the output
  has that dtype: bf16 logits come back as float32.
* No filter ever removes the highest logit: each keeps at least the argmax token and every
  token tied with it. Tokens already at `-inf` stay there, and a row that is all `-inf` (nothing
  left to sample) stays all `-inf`.
* Ties: a filter keeps every token tied with the last token it keeps, so the kept set depends on
  the values alone, never on the order of the vocabulary (Hugging Face's top-k does the same).
* `k` and the forbidden token ids are static Python values. `temperature`, `p` and `min_p` may
  be Python numbers, checked when the function is traced (and `p = 1`, `min_p = 0` then cost
  nothing), or traced scalars, which can change between calls without a recompilation and are
  not checked.

Temperature 0 (greedy decoding) is not a processor: the sampler takes an exact argmax of the
logits instead of dividing by 0. `check_sampling_args` validates a whole sampling configuration
in plain Python before anything is compiled.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._typing import Scalar


def _check_temperature(temperature: object, name: str, *, greedy_ok: bool) -> None:
    """Reject a negative or non-finite temperature, and 0 unless `greedy_ok`."""
    if greedy_ok:
        v.number_in(temperature, name, low=0, explain="0 = greedy decoding, an exact argmax")
    else:
        v.number_in(
            temperature,
            name,
            low=0,
            low_open=True,
            hint=f"{name} 0 means greedy decoding, which the sampler does with an exact argmax "
            "of the logits instead of scaling them",
        )
    v.finite_number(temperature, name)
    if isinstance(temperature, int | float | np.floating) and 0 < temperature < _TINY:
        raise ValueError(
            f"{name} must be 0 (greedy decoding) or at least {_TINY:.3g}, float32's smallest "
            f"normal number, got {temperature!r}: below it the temperature is flushed to 0 "
            "and the logits divided by it are NaN"
        )


# float32's smallest normal number: XLA flushes smaller (subnormal) values to zero.
_TINY = float(np.finfo(np.float32).tiny)


def _check_top_k(k: object, name: str) -> None:
    v.static_int(k, name, what="a Python int >= 1 (a static value: it fixes a shape)")
    v.number_in(k, name, low=1, hint="None turns top-k off")


def _check_top_p(p: object, name: str) -> None:
    v.number_in(p, name, low=0, high=1, low_open=True, hint="1 keeps every token")


def _check_min_p(min_p: object, name: str) -> None:
    v.number_in(min_p, name, low=0, high=1, hint="0 keeps every token")


def _check_not_all_forbidden(token_ids: tuple[int, ...], vocab_size: int) -> None:
    if len(set(token_ids)) == vocab_size:
        raise ValueError(
            f"forbidden_tokens forbids all {vocab_size} tokens of the vocabulary; at least one "
            "token must stay allowed."
        )


def _checked_logits(logits: ArrayLike) -> jax.Array:
    """`[B, V]` floating-point logits in the compute dtype (at least float32)."""
    logits = v.float_array(logits, "logits")
    if logits.ndim != 2 or logits.shape[-1] == 0:
        raise ValueError(
            f"logits must have shape [B, V] with V >= 1 (one row per sequence), got shape "
            f"{logits.shape}."
        )
    return logits.astype(v.compute_dtype(logits.dtype))


def _exclude(logits: jax.Array, keep: jax.Array) -> jax.Array:
    return jnp.where(keep, logits, -jnp.inf)


def temperature_scale(logits: Float[ArrayLike, "B V"], temperature: Scalar) -> Float[Array, "B V"]:
    r"""Logits divided by the sampling temperature.

    $$
    z'_v = z_v / \tau
    $$

    with logits $z$ = `logits` and temperature $\tau$ = `temperature`: sampling from
    $\mathrm{softmax}(z / \tau)$ sharpens the distribution for $\tau < 1$ and flattens it for
    $\tau > 1$. `-inf` logits stay `-inf`.

    Args:
      logits: `[B, V]` unnormalised scores, any float dtype (computed in float32).
      temperature: $\tau > 0$, finite; may be traced. $\tau = 0$ (greedy decoding) is rejected
        here: the sampler takes an exact argmax instead.

    Returns:
      `[B, V]` scaled logits, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.rollout import temperature_scale
      >>> print(temperature_scale(jnp.array([[2.0, 1.0, -jnp.inf]]), 0.5))
      [[  4.   2. -inf]]

    References:
      Ackley, Hinton and Sejnowski, "A Learning Algorithm for Boltzmann Machines", Cognitive
      Science 9(1), 1985, https://doi.org/10.1207/s15516709cog0901_7.
    """
    _check_temperature(temperature, "temperature", greedy_ok=False)
    logits = _checked_logits(logits)
    return logits / jnp.asarray(temperature, logits.dtype)


def top_k_filter(logits: Float[ArrayLike, "B V"], k: int) -> Float[Array, "B V"]:
    r"""Keep the `k` largest logits of each row; the others become `-inf`.

    $$
    z'_v = \begin{cases} z_v & z_v \ge z_{(k)} \\ -\infty & \text{otherwise} \end{cases}
    $$

    where $z_{(k)}$ is the $k$-th largest logit of the row. Every token tied with the $k$-th
    largest is kept, so a row can keep more than $k$ tokens (as Hugging Face's
    `TopKLogitsWarper` does); the threshold comes from `jax.lax.top_k`, not a sort of the
    vocabulary.

    Args:
      logits: `[B, V]` unnormalised scores, any float dtype (computed in float32).
      k: static Python int >= 1; `k >= V` keeps every token.

    Returns:
      `[B, V]` filtered logits, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.rollout import top_k_filter
      >>> print(top_k_filter(jnp.array([[3.0, 1.0, 2.0, 0.0], [1.0, 2.0, 2.0, 0.0]]), 2))
      [[  3. -inf   2. -inf]
       [-inf   2.   2. -inf]]
      >>> print(top_k_filter(jnp.array([[1.0, 2.0, 2.0, 0.0]]), 1))  # tied at the top: both
      [[-inf   2.   2. -inf]]

    References:
      Fan, Lewis and Dauphin, "Hierarchical Neural Story Generation", 2018,
      https://arxiv.org/abs/1805.04833.
    """
    _check_top_k(k, "k")
    logits = _checked_logits(logits)
    if k >= logits.shape[-1]:
        return logits
    kth_largest = jax.lax.top_k(logits, k)[0][:, -1:]
    return _exclude(logits, logits >= kth_largest)


_BisectionState = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def _bisection_step(_: jax.Array | int, state: _BisectionState) -> _BisectionState:
    """Halve `[lo, hi)`, the bit patterns of thresholds, keeping "mass at lo >= p"."""
    probs, p, lo, hi = state
    mid = lo + (hi - lo) // 2
    threshold = jax.lax.bitcast_convert_type(mid, probs.dtype)
    enough = jnp.sum(jnp.where(probs >= threshold, probs, 0.0), axis=-1, keepdims=True) >= p
    return probs, p, jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)


def _bisection_steps(dtype: jnp.dtype) -> int:
    """Bits in the pattern of 1.0, so that the steps shrink `[0, bits(1.0)]` to one value."""
    int_dtype = np.int32 if dtype == np.float32 else np.int64
    return np.ones((), dtype).view(int_dtype).item().bit_length()


def _bisect_rolled(state: _BisectionState) -> _BisectionState:
    return jax.lax.fori_loop(0, _bisection_steps(state[0].dtype), _bisection_step, state)


def _bisect_unrolled(state: _BisectionState) -> _BisectionState:
    for step in range(_bisection_steps(state[0].dtype)):
        state = _bisection_step(step, state)
    return state


def _nucleus_threshold(probs: jax.Array, p: jax.Array) -> jax.Array:
    r"""`[B, 1]` largest $t$ with $\sum_{v:\, \pi_v \ge t} \pi_v \ge p$, without a sort.

    Non-negative floats order like their bit patterns read as integers, so a bisection over the
    bit patterns in $[0, \text{bits}(\max_v \pi_v)]$ finds $t$ exactly in as many steps as
    `bits(1.0)` has bits (30 in float32), each step one masked sum over the vocabulary. The
    masked sum is non-increasing in $t$ (float rounding is monotone), so the bisection is sound,
    and the $t$ it finds is the probability of the token whose mass crosses $p$. The invariant
    "the mass at `lo` reaches $p$" is assumed, not tested, at `lo = 0`: if the total mass in
    floating point stays below $p$ (possible only for $p$ within rounding of 1), $t = 0$ keeps
    every token.

    The loop is rolled on CPU and unrolled elsewhere. On GPU a rolled loop pays a round trip
    for its condition at every step (on an H200, `[8, 32000]` logits took 0.56 ms rolled and
    0.11 ms unrolled); on CPU both run alike, but XLA fuses the unrolled chain of `lo, hi`
    updates into every later step, and for a small vocabulary the compilation then takes
    seconds instead of a fraction of one.
    """
    int_dtype = jnp.int32 if probs.dtype == jnp.float32 else jnp.int64
    top = jnp.max(probs, axis=-1, keepdims=True)
    hi = jax.lax.bitcast_convert_type(top, int_dtype) + 1
    state = (probs, p, jnp.zeros_like(hi), hi)
    _, _, lo, _ = jax.lax.platform_dependent(state, cpu=_bisect_rolled, default=_bisect_unrolled)
    return jax.lax.bitcast_convert_type(lo, probs.dtype)


def top_p_filter(logits: Float[ArrayLike, "B V"], p: Scalar) -> Float[Array, "B V"]:
    r"""Nucleus filtering: keep the most probable tokens whose total probability first reaches `p`.

    $$
    V^{(p)} = \Big\{ v : \sum_{u:\, \pi_u > \pi_v} \pi_u < p \Big\}, \qquad
    \pi = \mathrm{softmax}(z),
    $$

    with logits $z$ = `logits` and $p$ = `p`; tokens outside $V^{(p)}$ become `-inf`. With
    distinct probabilities this is Holtzman et al.'s smallest set of most probable tokens whose
    cumulative probability is $\ge p$: sort the probabilities in decreasing order and keep each
    token whose cumulative probability *before* it is still $< p$, so the token that crosses
    $p$ is kept. With ties, every token tied with that crossing token is kept too (a sort would
    keep an arbitrary subset of them). The argmax is always kept.

    No sort of the vocabulary: the smallest kept probability is found by a bisection over the
    bit patterns of float32 thresholds, 30 steps of one masked sum over `V` each. The set is
    exact for the float32 probabilities; it can differ from the infinitely precise one only
    where a cumulative probability lies within float32 summation error of `p`, where a float32
    sort-based filter is just as uncertain.

    Args:
      logits: `[B, V]` unnormalised scores, any float dtype (computed in float32).
      p: nucleus mass in $(0, 1]$; may be traced. `p = 1` keeps every token; a Python 1
        returns the logits without computing anything.

    Returns:
      `[B, V]` filtered logits, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.rollout import top_p_filter
      >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
      >>> print(top_p_filter(logits, 0.7).round(2))  # 0.5 < 0.7 <= 0.5 + 0.3
      [[-0.69 -1.2   -inf  -inf]]
      >>> print(top_p_filter(logits, 0.9).round(2))  # 0.5 + 0.3 < 0.9 <= 0.5 + 0.3 + 0.15
      [[-0.69 -1.2  -1.9   -inf]]

    References:
      Holtzman et al., "The Curious Case of Neural Text Degeneration", 2020,
      https://arxiv.org/abs/1904.09751.
    """
    _check_top_p(p, "p")
    logits = _checked_logits(logits)
    if v.is_real_number(p) and p == 1:
        return logits
    p = jnp.asarray(p, logits.dtype)
    probs = jax.nn.softmax(logits, axis=-1)
    # p >= 1 keeps everything even where the float32 total of the probabilities rounds to > 1.
    return _exclude(logits, (probs >= _nucleus_threshold(probs, p)) | (p >= 1))


def min_p_filter(logits: Float[ArrayLike, "B V"], min_p: Scalar) -> Float[Array, "B V"]:
    r"""Min-p filtering: keep the tokens at least `min_p` times as probable as the most probable.

    $$
    z'_v = \begin{cases} z_v & \pi_v \ge p_{\min} \max_u \pi_u \\ -\infty & \text{otherwise}
    \end{cases}, \qquad \pi = \mathrm{softmax}(z),
    $$

    with logits $z$ = `logits` and $p_{\min}$ = `min_p`. The condition is computed in log space,
    $z_v - \max_u z_u \ge \log p_{\min}$, which needs no softmax. The threshold scales with the
    model's confidence: a peaked distribution keeps few tokens, a flat one many.

    Args:
      logits: `[B, V]` unnormalised scores, any float dtype (computed in float32).
      min_p: $p_{\min} \in [0, 1]$; may be traced. 0 keeps every token (a Python 0 returns the
        logits unchanged), 1 keeps only the argmax and its ties.

    Returns:
      `[B, V]` filtered logits, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.rollout import min_p_filter
      >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
      >>> print(min_p_filter(logits, 0.25).round(2))  # keeps pi >= 0.25 * 0.5
      [[-0.69 -1.2  -1.9   -inf]]

    References:
      Nguyen et al., "Turning Up the Heat: Min-p Sampling for Creative and Coherent LLM
      Outputs", 2024, https://arxiv.org/abs/2407.01082.
    """
    _check_min_p(min_p, "min_p")
    logits = _checked_logits(logits)
    if v.is_real_number(min_p) and min_p == 0:
        return logits
    top = jnp.max(logits, axis=-1, keepdims=True)
    log_min_p = jnp.log(jnp.asarray(min_p, logits.dtype))
    # `logits == top` keeps the argmax even where the difference is NaN (a row of -inf).
    return _exclude(logits, (logits - top >= log_min_p) | (logits == top))


def forbid_tokens(logits: Float[ArrayLike, "B V"], token_ids: Sequence[int]) -> Float[Array, "B V"]:
    r"""Set the logits of the given token ids to `-inf`, in every row.

    $$
    z'_v = -\infty \ \text{for}\ v \in F, \qquad z'_v = z_v \ \text{otherwise},
    $$

    with $F$ = `token_ids`. Unlike the filters, this removes the argmax if it is forbidden.

    Args:
      logits: `[B, V]` unnormalised scores, any float dtype (computed in float32).
      token_ids: static tuple of int token ids in `[0, V)` (repeats allowed), the
        `forbidden_tokens` of `process_logits`. A `ValueError` naming `forbidden_tokens` is
        raised when an id lies outside `[0, V)` or when the ids cover the whole vocabulary. A row
        whose only finite logits are forbidden becomes all `-inf`.

    Returns:
      `[B, V]` logits, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.rollout import forbid_tokens
      >>> print(forbid_tokens(jnp.array([[3.0, 1.0, 2.0]]), (0, 2)))
      [[-inf   1. -inf]]
    """
    logits = _checked_logits(logits)
    vocab_size = logits.shape[-1]
    token_ids = v.token_id_tuple(token_ids, "forbidden_tokens", vocab_size=vocab_size)
    _check_not_all_forbidden(token_ids, vocab_size)
    if not token_ids:
        return logits
    forbidden = np.zeros(vocab_size, np.bool_)
    forbidden[list(token_ids)] = True
    return jnp.where(forbidden, -jnp.inf, logits)


def process_logits(
    logits: Float[ArrayLike, "B V"],
    *,
    temperature: Scalar = 1.0,
    top_k: int | None = None,
    top_p: Scalar | None = None,
    min_p: Scalar | None = None,
    forbidden_tokens: Sequence[int] = (),
) -> Float[Array, "B V"]:
    r"""The sampling distribution's logits: forbid, then temperature, top-k, top-p and min-p.

    $$
    z' = \mathrm{minp}_{p_{\min}}\Big(\mathrm{topp}_p\big(\mathrm{topk}_k
    (\mathrm{forbid}_F(z) / \tau)\big)\Big)
    $$

    with $F$ = `forbidden_tokens`, $\tau$ = `temperature`, $k$ = `top_k`, $p$ = `top_p`,
    $p_{\min}$ = `min_p`; a None filter is skipped. Why this order:

    * Forbidden tokens go first, so no filter spends its budget on a token that can never be
      drawn: top-k keeps `k` allowed tokens, top-p renormalises over allowed tokens only.
    * The temperature comes before the filters, so top-p and min-p see the tempered
      distribution that is actually sampled (top-k is unaffected: dividing by $\tau > 0$ keeps
      the order). Hugging Face `generate` and vLLM do the same.
    * Top-k, top-p, min-p is Hugging Face's order. Top-p renormalises over what top-k kept.
      vLLM (v1) applies min-p before top-k and top-p instead; min-p's own test is unchanged by
      an earlier filter (a ratio to the kept maximum), but top-p then measures its mass over
      the min-p survivors, so the two orders can keep different sets.

    Every filter keeps the argmax of what it receives, so the result always has a finite entry
    unless every allowed logit of the row was `-inf` already.

    Args:
      logits: `[B, V]` unnormalised scores, any float dtype (computed in float32).
      temperature: $\tau > 0$; may be traced. Default 1 (no scaling). Greedy decoding
        (temperature 0) is the sampler's exact argmax, not this function.
      top_k: static int >= 1, or None (default) for no top-k filter.
      top_p: nucleus mass in $(0, 1]$, or None (default) for no top-p filter; may be traced.
      min_p: in $[0, 1]$, or None (default) for no min-p filter; may be traced.
      forbidden_tokens: static tuple of token ids in `[0, V)` that are never sampled; default
        none.

    Returns:
      `[B, V]` logits to sample from, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.rollout import process_logits
      >>> logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
      >>> print(process_logits(logits, top_p=0.6))  # softmax: 0.64, 0.24, 0.09, 0.03
      [[   2. -inf -inf -inf]]
      >>> print(process_logits(logits, temperature=4.0, top_p=0.6))  # 0.36, 0.28, 0.2, 0.16
      [[0.5  0.25 -inf -inf]]
      >>> print(process_logits(logits, temperature=4.0, top_p=0.6, forbidden_tokens=(0,)))
      [[-inf 0.25  0.  -inf]]
    """
    _check_temperature(temperature, "temperature", greedy_ok=False)
    if top_k is not None:
        _check_top_k(top_k, "top_k")
    if top_p is not None:
        _check_top_p(top_p, "top_p")
    if min_p is not None:
        _check_min_p(min_p, "min_p")
    logits = forbid_tokens(logits, forbidden_tokens)
    if not (v.is_real_number(temperature) and temperature == 1):
        logits = temperature_scale(logits, temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    if min_p is not None:
        logits = min_p_filter(logits, min_p)
    return logits


def check_sampling_args(
    *,
    vocab_size: int,
    temperature: float | int,
    top_k: int | None,
    top_p: float | int | None,
    min_p: float | int | None,
    forbidden_tokens: Sequence[int],
    stop_tokens: Sequence[int],
) -> None:
    """Validate a sampling configuration in plain Python, before anything is compiled.

    The sampler calls this first, so a bad value fails at once with a message that names the
    argument and the value, instead of deep inside a trace (or, for a value that would be
    traced, not at all). Each argument means what it means in `process_logits`, except that
    temperature 0 is allowed here: it selects greedy decoding.

    Args:
      vocab_size: `V`, an int >= 1.
      temperature: a finite number >= 0; 0 = greedy decoding (exact argmax).
      top_k: an int >= 1, or None.
      top_p: a number in (0, 1], or None.
      min_p: a number in [0, 1], or None.
      forbidden_tokens: a tuple of int token ids in `[0, V)`; they may not cover the whole
        vocabulary.
      stop_tokens: a tuple of int token ids in `[0, V)`.

    Raises:
      TypeError: for a value of the wrong type (a float `top_k`, a string `top_p`, a token id
        that is not an int, token ids that are not a sequence).
      ValueError: for a value out of its range, or when every token is forbidden.

    Examples:
      >>> from tunelib.rollout import check_sampling_args
      >>> check_sampling_args(vocab_size=8, temperature=0.0, top_k=None, top_p=0.9, min_p=None,
      ...                     forbidden_tokens=(0,), stop_tokens=(7,))
      >>> check_sampling_args(vocab_size=8, temperature=0.7, top_k=0, top_p=None, min_p=None,
      ...                     forbidden_tokens=(), stop_tokens=())
      Traceback (most recent call last):
      ...
      ValueError: top_k must be >= 1, got 0; None turns top-k off.
    """
    v.static_int(vocab_size, "vocab_size")
    v.number_in(vocab_size, "vocab_size", low=1)
    check_sampling_values(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    forbidden = v.token_id_tuple(forbidden_tokens, "forbidden_tokens", vocab_size=vocab_size)
    v.token_id_tuple(stop_tokens, "stop_tokens", vocab_size=vocab_size)
    _check_not_all_forbidden(forbidden, vocab_size)


def check_sampling_values(
    *,
    temperature: object,
    top_k: object,
    top_p: object,
    min_p: object,
) -> None:
    """The checks of `check_sampling_args` that need no vocabulary, in plain Python.

    `SamplingConfig` runs them when it is made: temperature a finite number >= 0 (0 = greedy),
    `top_k` an int >= 1, `top_p` a number in (0, 1], `min_p` a number in [0, 1], each but the
    temperature also None.
    """
    v.real_number(temperature, "temperature")
    _check_temperature(temperature, "temperature", greedy_ok=True)
    if top_k is not None:
        _check_top_k(top_k, "top_k")
    if top_p is not None:
        v.real_number(top_p, "top_p")
        _check_top_p(top_p, "top_p")
    if min_p is not None:
        v.real_number(min_p, "min_p")
        _check_min_p(min_p, "min_p")
