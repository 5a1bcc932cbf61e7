import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests._helpers import assert_close, assert_traced_once, own_checks, raises_naming
from tests.logprobs.test_token import ref_entropy, ref_token_logps
from tunelib.logprobs import fused_token_logps

# Jitted once per shape and option set: op-by-op dispatch would compile every operation of
# the tiled loops (and of their gradients) for each shape instead.
STATIC = ("with_entropy", "chunk_size", "implementation", "vocab_axis")
fused = jax.jit(fused_token_logps, static_argnames=STATIC)


def problem(n, h, v, seed=0, dtype=np.float32, bias=False):
    """NumPy data (drawing it with `jax.random` would compile the sampler for every shape)."""
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(n, h)).astype(dtype)
    w = (rng.normal(size=(h, v)) * 0.7).astype(dtype)
    targets = rng.integers(0, v, n).astype(np.int32)
    b = (rng.normal(size=v) * 0.5).astype(dtype) if bias else None
    return hidden, w, targets, b


def objective(implementation, chunk_size=16, temperature=1.0, where=None, seed=1):
    """A scalar with random per-token weights on log-probs and entropies."""

    def f(hidden, w, b, targets):
        logps, entropy = fused_token_logps(
            hidden, w, targets, bias=b, temperature=temperature, with_entropy=True,
            where=where, chunk_size=chunk_size, implementation=implementation,
        )  # fmt: skip
        n = logps.shape[0]
        g = jax.random.normal(jax.random.key(seed), (2, n))
        return jnp.sum(g[0] * logps) + jnp.sum(g[1] * entropy)

    return f


@functools.partial(jax.jit, static_argnames=("implementation", "chunk_size"))
def values_and_grads(hidden, w, b, targets, temperature, implementation, chunk_size):
    f = objective(implementation, chunk_size, temperature)
    return jax.value_and_grad(f, argnums=(0, 1, 2))(hidden, w, b, targets)


# (N, H, V) and a tile width: one tile wider than V, a last tile that does not divide V, tiles
# that divide it, tiles of one column. Few combinations, so that few compile.
TILINGS = [((1, 8, 5), 100), ((7, 16, 37), 16), ((12, 8, 64), 16), ((7, 16, 37), 1)]


@settings(max_examples=12)
@given(st.sampled_from(TILINGS), st.floats(0.5, 2.0), st.booleans())
def test_values_and_gradients_match_the_materialised_logits(tiling, tau, with_bias):
    """In float64, where the tiles' and the materialised logits' orders of summation agree to
    rounding (in float32 the gradients moved by 0.25 of a fixed rtol 1e-4 on this CPU)."""
    shape, chunk = tiling
    hidden, w, targets, b = problem(*shape, bias=with_bias, dtype=np.float64)
    if b is None:
        b = np.zeros(w.shape[1])  # a zero bias: the gradient is still checked
    with jax.enable_x64(True):
        ours = values_and_grads(hidden, w, b, targets, np.float64(tau), "chunked", chunk)
        naive = values_and_grads(hidden, w, b, targets, np.float64(tau), "naive", 16)
    assert ours[0].dtype == jnp.float64
    assert_close(ours[0], naive[0], rtol=1e-12, atol=1e-12)
    for a, e in zip(ours[1], naive[1], strict=True):
        assert a.dtype == jnp.float64
        assert_close(a, e, rtol=1e-10, atol=1e-12 * max(1.0, np.abs(e).max()))


def test_fixed_values_against_float64_numpy():
    hidden, w, targets, b = problem(9, 8, 41, bias=True)
    logits = np.asarray(hidden, np.float64) @ np.asarray(w, np.float64) + np.asarray(b)
    for tau in (1.0, 0.7):
        logps, entropy = fused(
            hidden, w, targets, bias=b, temperature=tau, with_entropy=True, chunk_size=10
        )
        assert_close(logps, ref_token_logps(logits, targets, tau), atol=2e-5)
        assert_close(entropy, ref_entropy(logits, tau), atol=2e-5)


@pytest.mark.parametrize("implementation", ["chunked", "naive"])
def test_a_likely_tokens_logp_is_exact_to_the_rounding_of_the_others(implementation):
    """`log pi(y) = z_y - lse` with `z_y` read from the logits the log-sum-exp sums: for a
    token of probability p near 1 the error is then at most about 2 (1 - p) max|dz| (dz the
    float32 logits' rounding), not the rounding of `z_y` itself, which a second product for
    the target column (summed in another order) would add whole. Logits near 56 leave that
    rounding some ULPs of 56 (about 4e-6 each) on every CPU."""
    rng = np.random.default_rng(0)
    n, h, v = 64, 512, 1000
    hidden = rng.normal(size=(n, h))
    hidden[:, 0] = 8.0
    w = rng.normal(size=(h, v)) * 0.01
    w[0] += 6.0  # every logit about 48
    w[:, :n] += 14 * hidden.T / np.square(np.linalg.norm(hidden, axis=1))  # token i leads row i
    hidden, w, targets = hidden.astype(np.float32), w.astype(np.float32), np.arange(n)
    exact = np.asarray(hidden, np.float64) @ np.asarray(w, np.float64)
    rounding = np.abs(np.asarray(jnp.asarray(hidden) @ jnp.asarray(w), np.float64) - exact).max()
    want = ref_token_logps(exact, targets, 1.0)
    tolerance = 4 * (1 - np.exp(want.min())) * rounding
    assert tolerance < rounding / 50  # the target logit's own rounding would fail the test
    got = fused(hidden, w, targets, chunk_size=128, implementation=implementation)
    assert_close(got, want, rtol=0, atol=tolerance)


@jax.jit
def masked_values_and_grads(hidden, w, targets, where):
    return jax.value_and_grad(
        lambda h, w: fused_token_logps(h, w, targets, where=where, chunk_size=7).sum(), (0, 1)
    )(hidden, w)


def test_leading_axes_masks_and_nan_at_masked_positions():
    hidden, w, targets, _ = problem(12, 8, 30)
    hidden = hidden.reshape(3, 4, 8)
    hidden[1, 2] = np.nan
    targets = targets.reshape(3, 4)
    targets[1, 2] = -100
    where = np.ones((3, 4), bool)
    where[1, 2] = where[2] = False
    value, (dh, dw) = masked_values_and_grads(hidden, w, targets, where)
    assert np.isfinite(value) and np.all(np.isfinite(dh)) and np.all(np.isfinite(dw))
    assert np.all(np.asarray(dh)[~where] == 0)
    sliced = fused(hidden[where], w, targets[where], chunk_size=7)
    out = fused(hidden, w, targets, where=where, chunk_size=7)
    assert_close(np.asarray(out)[where], sliced, atol=1e-6)
    assert np.all(np.asarray(out)[~where] == 0)
    nothing = fused(hidden, w, targets, where=np.zeros_like(where), chunk_size=7)
    assert np.all(np.asarray(nothing) == 0)


def test_bf16_inputs_within_tolerance_of_float32():
    hidden, w, targets, _ = problem(16, 32, 200)
    h16, w16 = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    low = fused(h16, w16, targets)
    assert low.dtype == jnp.float32
    exact = ref_token_logps(np.asarray(h16, np.float64) @ np.asarray(w16, np.float64), targets)
    # Inputs rounded to bf16, products accumulated in float32: only accumulation error remains.
    assert_close(low, exact, atol=1e-3)
    assert_close(low, fused(hidden, w, targets), atol=0.5)
    grads = jax.jit(
        jax.grad(lambda h, w: fused_token_logps(h, w, targets, chunk_size=64).sum(), (0, 1))
    )(h16, w16)
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.bfloat16


@pytest.mark.parametrize("chunk_size", [7, 64])
def test_bf16_gradients_are_the_float32_ones_rounded_once(chunk_size):
    # V = 200 in tiles of 7: 29 tiles, more than one flush group of the 16-bit gradient and a
    # last tile shifted left over its neighbour's columns; tiles of 64: four, the last shifted.
    hidden, w, targets, b = problem(24, 16, 200, bias=True)
    low = [jnp.asarray(x, jnp.bfloat16) for x in (hidden, w, b)]
    rounded = [np.asarray(x, np.float32) for x in low]
    tau = jnp.float32(0.8)
    _, grads = values_and_grads(*low, targets, tau, "chunked", chunk_size)
    _, exact = values_and_grads(*rounded, targets, tau, "chunked", chunk_size)
    for grad, ref in zip(grads, exact, strict=True):
        assert grad.dtype == jnp.bfloat16
        # Accumulated in float32 within a tile and rounded once: within one bf16 rounding
        # (2^-8 relative) of the float32 gradient, column by column.
        ref = np.asarray(ref)
        err = np.abs(np.asarray(grad, np.float32) - ref)
        assert np.all(err <= 2.0**-8 * np.abs(ref) + 1e-6), err.max()


def test_bf16_temporaries_stay_below_the_gradients():
    n, h = 1024, 256

    def temp_bytes(v):
        specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((n, h), (h, v))]
        f = jax.jit(
            jax.grad(lambda h, w, y: fused_token_logps(h, w, y, chunk_size=512).mean(), (0, 1))
        )
        compiled = f.lower(*specs, jax.ShapeDtypeStruct((n,), jnp.int32)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(32768), temp_bytes(65536)
    # The unembedding's gradient is written tile by tile in bf16, never accumulated in a
    # float32 [H, V] array (which alone would be twice the bf16 gradients): the temporaries
    # are a few [N, 512] tiles, below the gradients' own size (0.46x measured on XLA CPU).
    assert small <= 1.1 * (n * h + h * 32768) * 2, small
    # 32,768 more columns add at most a tenth of their bf16 gradient (on CPU, a 16-bit
    # gradient is flushed from a uint16 buffer of 1/16 of its columns: 6 % measured).
    assert large - small <= 0.1 * h * 32768 * 2, (small, large)


def test_float64_stays_float64():
    with jax.enable_x64(True):
        hidden, w, targets, _ = problem(5, 4, 23, dtype=np.float64)
        out = fused(hidden, w, targets, chunk_size=6)
        assert out.dtype == jnp.float64
        assert_close(out, ref_token_logps(hidden @ w, targets), rtol=1e-12, atol=1e-12)


def test_vmap_jit_and_no_retrace():
    hidden, w, targets, _ = problem(12, 8, 30)
    batched = jax.jit(jax.vmap(lambda h, y: fused_token_logps(h, w, y, chunk_size=8)))(
        hidden.reshape(3, 4, 8), targets.reshape(3, 4)
    )
    expected = fused(hidden, w, targets, chunk_size=8)
    assert_close(batched, np.asarray(expected).reshape(3, 4), atol=1e-6)
    assert_traced_once(
        lambda h, w, y, tau: fused_token_logps(h, w, y, temperature=tau, chunk_size=8),
        [((hidden, w, targets, jnp.float32(t)), {}) for t in (0.5, 1.0, 2.0)],
    )


def test_temporary_memory_does_not_grow_with_n_times_v():
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((512, 64), (64, 8192))]
    targets = jax.ShapeDtypeStruct((512,), jnp.int32)

    def temp_bytes(implementation):
        f = jax.jit(
            jax.grad(
                lambda h, w, y: fused_token_logps(
                    h, w, y, chunk_size=512, implementation=implementation
                ).mean(),
                (0, 1),
            )
        )
        return f.lower(*specs, targets).compile().memory_analysis().temp_size_in_bytes

    naive, chunked = temp_bytes("naive"), temp_bytes("chunked")
    # The logits alone are 512 x 8192 x 4 bytes = 16 MiB; the chunked path holds a few
    # 512 x 512 tiles.
    assert naive >= 512 * 8192 * 4
    assert chunked * 8 < naive, (chunked, naive)


def mesh(shape, names):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


def test_batch_sharded_over_eight_devices_equals_one_device():
    hidden, w, targets, b = problem(16, 8, 40, bias=True)
    f = objective("chunked", chunk_size=16, temperature=0.9)
    grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
    expected = grad(hidden, w, b, targets)
    m = mesh((8,), ("data",))
    put = lambda x, spec: jax.device_put(x, NamedSharding(m, spec))  # noqa: E731
    sharded = grad(put(hidden, P("data")), put(w, P()), put(b, P()), put(targets, P("data")))
    assert_close(sharded[0], expected[0], rtol=1e-5, atol=1e-5)
    for a, e in zip(sharded[1], expected[1], strict=True):
        assert_close(a, e, rtol=1e-5, atol=1e-5)


def sharded_values_and_grads(fn, hidden, w, b, targets):
    """`fn`'s log-probs and entropies, and the gradients of a weighted sum of them, under jit."""
    weights = jax.random.normal(jax.random.key(5), (2, hidden.shape[0]))

    def total(h, w, b):
        logps, entropy = fn(h, w, b, targets)
        return jnp.sum(weights[0] * logps) + jnp.sum(weights[1] * entropy)

    return fn(hidden, w, b, targets), jax.grad(total, (0, 1, 2))(hidden, w, b)


@jax.jit
def unsharded_values_and_grads(hidden, w, b, targets):
    def plain(h, w, b, y):
        return fused_token_logps(h, w, y, bias=b, temperature=1.1, with_entropy=True)

    return sharded_values_and_grads(plain, hidden, w, b, targets)


@pytest.mark.parametrize("implementation", ["chunked", "naive"])
def test_vocabulary_sharded_over_a_model_axis_equals_unsharded(implementation):
    hidden, w, targets, b = problem(12, 8, 64, bias=True)
    m = mesh((2, 4), ("data", "model"))

    def local(h, w, b, y):
        logps, entropy = fused_token_logps(
            h, w, y, bias=b, temperature=1.1, with_entropy=True, chunk_size=6,
            implementation=implementation, vocab_axis="model",
        )  # fmt: skip
        return logps, entropy

    sharded = jax.shard_map(
        local,
        mesh=m,
        in_specs=(P("data"), P(None, "model"), P("model"), P("data")),
        out_specs=(P("data"), P("data")),
    )
    got, got_grads = jax.jit(functools.partial(sharded_values_and_grads, sharded))(
        hidden, w, b, targets
    )
    expected, expected_grads = unsharded_values_and_grads(hidden, w, b, targets)
    assert_close(got[0], expected[0], atol=2e-5)
    assert_close(got[1], expected[1], atol=2e-5)
    for a, e in zip(got_grads, expected_grads, strict=True):
        assert_close(a, e, rtol=1e-4, atol=2e-5)


def test_errors_name_the_argument():
    hidden, w, targets, _ = problem(4, 8, 10)
    with raises_naming("unembedding"):
        fused_token_logps(hidden, w.T, targets)
    with raises_naming("targets"):
        fused_token_logps(hidden, w, targets[:3])
    with raises_naming("implementation"):
        fused_token_logps(hidden, w, targets, implementation="fast")
    with own_checks():
        with raises_naming("targets", "(3,)", "(4,)", error=ValueError):
            fused_token_logps(hidden, w, targets[:3])
        with raises_naming("bias", error=ValueError):
            fused_token_logps(hidden, w, targets, bias=np.zeros(9, np.float32))
        with raises_naming("hidden", error=TypeError):
            fused_token_logps(hidden.astype(int), w, targets)
        with raises_naming("chunk_size", error=ValueError):
            fused_token_logps(hidden, w, targets, chunk_size=0)
        with raises_naming("temperature", error=ValueError):
            fused_token_logps(hidden, w, targets, temperature=0.0)


def test_temperature_gradient_matches_the_materialised_logits():
    hidden, w, targets, b = problem(7, 8, 37, bias=True)

    @functools.partial(jax.jit, static_argnames="implementation")
    def grad_tau(tau, implementation):
        def of_tau(tau):
            return objective(implementation, chunk_size=10, temperature=tau)(hidden, w, b, targets)

        return jax.grad(of_tau)(tau)

    tau = np.float32(1.3)
    assert_close(grad_tau(tau, "chunked"), grad_tau(tau, "naive"), rtol=1e-4, atol=1e-5)


def test_forced_pallas_on_cpu_runs_the_kernel_in_the_interpreter():
    """In float64, where the kernel's tiles and the materialised logits agree to rounding (in
    float32 their orders of summation used 0.2 of a fixed 1e-5 on this CPU)."""
    hidden, w, targets, b = problem(10, 16, 150, bias=True, dtype=np.float64)
    kwargs = {"bias": b, "with_entropy": True, "temperature": 0.8}
    with jax.enable_x64(True):
        ours = fused(hidden, w, targets, **kwargs, implementation="pallas")
        reference = fused(hidden, w, targets, **kwargs, implementation="naive")
    for a, e in zip(ours, reference, strict=True):
        assert a.dtype == jnp.float64
        assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implementation", ["chunked", "naive"])
def test_targets_outside_the_vocabulary(implementation):
    hidden, w, targets, _ = problem(4, 8, 10)
    kwargs = {"chunk_size": 4, "implementation": implementation}
    with raises_naming("targets", "10", "V = 10", error=ValueError):
        fused_token_logps(hidden, w, np.where(np.arange(4) == 1, 10, targets), **kwargs)
    # A masked position may hold anything; under jit a counted one out of range is NaN.
    bad = targets.copy()
    bad[1], bad[2] = -1, 10
    where = np.array([True, True, False, True])
    out = fused(hidden, w, bad, where=where, **kwargs)
    expected = fused(hidden, w, targets, where=np.ones(4, bool), **kwargs)
    assert np.isnan(out[1]) and out[2] == 0
    assert_close(out[np.array([0, 3])], expected[np.array([0, 3])], rtol=1e-6)
    # An integer 0/1 mask counts like the boolean one.
    np.testing.assert_array_equal(
        fused(hidden, w, targets, where=where.astype(np.int32), **kwargs),
        fused(hidden, w, targets, where=where, **kwargs),
    )
