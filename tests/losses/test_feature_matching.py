import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, assert_traced_once, float_arrays, own_checks, raises_naming
from tunelib import losses

EPS = 1e-8


def ref_vector_loss(student, teacher, projection, metric):
    """Per-vector loss over the last axis in float64: 1 - cosine, or mean squared error."""
    a = np.asarray(student, np.float64)
    if projection is not None:
        a = a @ np.asarray(projection, np.float64)
    b = np.asarray(teacher, np.float64)
    if metric == "mse":
        return ((a - b) ** 2).mean(-1)
    norm_a = np.maximum(np.linalg.norm(a, axis=-1), EPS)
    norm_b = np.maximum(np.linalg.norm(b, axis=-1), EPS)
    return 1 - (a * b).sum(-1) / (norm_a * norm_b)


def ref_feature(student, teacher, projection=None, metric="cosine"):
    return ref_vector_loss(student, teacher, projection, metric)


def ref_attention(student, teacher, projection=None, metric="cosine"):
    return ref_vector_loss(student, teacher, projection, metric).mean(-1)


@jax.jit
def both_metrics(student, teacher, projection, heads_student, heads_teacher):
    return {
        metric: (
            losses.feature_matching_loss(student, teacher, projection=projection, metric=metric),
            losses.attention_output_matching_loss(
                heads_student, heads_teacher, projection=projection, metric=metric
            ),
        )
        for metric in ("cosine", "mse")
    }


@st.composite
def feature_problems(draw):
    # Few distinct shapes: `both_metrics` compiles once per shape.
    (b, t, n), (ds, dt) = (
        draw(st.sampled_from([(1, 2, 1), (2, 3, 2)])),
        draw(st.sampled_from([(3, 3), (2, 4), (4, 3)])),
    )
    return (
        draw(float_arrays((b, t, ds), -5, 5)),
        draw(float_arrays((b, t, dt), -5, 5)),
        draw(float_arrays((ds, dt), -2, 2)),
        draw(float_arrays((b, t, n, ds), -5, 5)),
        draw(float_arrays((b, t, n, dt), -5, 5)),
    )


def test_fixed_values():
    s = np.array([[[1.0, 2.0], [0.0, -1.0], [3.0, 0.5]]], np.float32)
    t = np.array([[[2.0, 1.0, 0.0], [1.0, 1.0, 1.0], [-1.0, 0.0, 2.0]]], np.float32)
    w = np.array([[1.0, 0.0, 0.5], [0.0, 1.0, -1.0]], np.float32)
    for metric in ("cosine", "mse"):
        out = losses.feature_matching_loss(s, t, projection=w, metric=metric)
        assert_close(out, ref_feature(s, t, w, metric))
    # By hand: W^T s_0 = [1, 2, -1.5], t_0 = [2, 1, 0].
    ps = np.array([1.0, 2.0, -1.5])
    cos = ps @ [2.0, 1.0, 0.0] / (np.linalg.norm(ps) * np.sqrt(5))
    out = losses.feature_matching_loss(s, t, projection=w)
    assert_close(out[0, 0], 1 - cos)
    out = losses.feature_matching_loss(s, t, projection=w, metric="mse")
    assert_close(out[0, 0], ((ps - [2.0, 1.0, 0.0]) ** 2).mean())
    # Without a projection (Ds = Dt), and per head.
    assert_close(losses.feature_matching_loss(t, t[:, ::-1]), ref_feature(t, t[:, ::-1]))
    heads_s, heads_t = s.reshape(1, 3, 1, 2).repeat(2, 2), t.reshape(1, 3, 1, 3).repeat(2, 2)
    heads_t = heads_t * np.array([1.0, -1.0])[:, None]
    out = losses.attention_output_matching_loss(heads_s, heads_t, projection=w)
    assert_close(out, ref_attention(heads_s, heads_t, w))
    # Opposite heads: (1 - cos) + (1 + cos) averages to 1.
    assert_close(out, np.ones((1, 3)))


@given(feature_problems())
def test_matches_reference(problem):
    s, t, w, hs, ht = problem
    out = both_metrics(s, t, w, hs, ht)
    for metric in ("cosine", "mse"):
        assert_close(out[metric][0], ref_feature(s, t, w, metric), rtol=1e-4, atol=1e-4)
        assert_close(out[metric][1], ref_attention(hs, ht, w, metric), rtol=1e-4, atol=1e-4)


@given(feature_problems(), st.floats(0.1, 10.0), st.floats(0.1, 10.0))
def test_properties(problem, scale_s, scale_t):
    s, t, w, hs, ht = problem
    out = both_metrics(s, t, w, hs, ht)
    for cos in out["cosine"]:
        assert np.all(np.asarray(cos) >= -1e-6) and np.all(np.asarray(cos) <= 2 + 1e-6)
    for mse in out["mse"]:
        assert np.all(np.asarray(mse) >= 0)
    # The cosine loss does not change when either vector is scaled by a positive number.
    # (Compared where the vectors are well away from 0, so that float32 rounding of the
    # projection does not turn their direction.)
    scaled = both_metrics(
        s * np.float32(scale_s), t * np.float32(scale_t), w, hs * np.float32(scale_s), ht
    )
    for i, (student, teacher) in enumerate(((s, t), (hs, ht))):
        clear = (np.linalg.norm(student.astype(np.float64) @ w, axis=-1) > 0.1) & (
            np.linalg.norm(teacher, axis=-1) > 0.1
        )
        if i == 1:
            clear = clear.all(-1)  # every head of the token
        assert_close(
            np.asarray(scaled["cosine"][i])[clear], np.asarray(out["cosine"][i])[clear], atol=5e-4
        )
    # A vector matched to itself (or to a positive multiple) gives 0; to its negative, 2.
    nonzero = np.linalg.norm(t, axis=-1) > 1e-3
    same = losses.feature_matching_loss(t * np.float32(scale_t), t)
    assert_close(np.asarray(same)[nonzero], 0.0, atol=1e-6)
    assert_close(np.asarray(losses.feature_matching_loss(-t, t))[nonzero], 2.0, atol=1e-6)
    assert np.all(np.asarray(losses.feature_matching_loss(t, t, metric="mse")) == 0)


def test_zero_vectors_and_epsilon():
    s = jnp.zeros((1, 2, 3))
    t = jnp.array([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    # A zero vector has cosine 0 with anything: loss 1, finite gradient.
    assert_close(losses.feature_matching_loss(s, t), [[1.0, 1.0]])
    grad = jax.grad(lambda x: losses.feature_matching_loss(x, t).sum())(s)
    assert np.all(np.isfinite(grad))
    # The gradient at 0 points along the teacher's vector (scaled by 1 / (eps |t|)).
    assert_close(grad[0, 0], -np.array([1.0, 2.0, 3.0]) / (EPS * np.sqrt(14)), rtol=1e-5)
    assert np.all(np.asarray(grad[0, 1]) == 0)
    tiny = jnp.array([[[1e-9, 0.0, 0.0]]])
    assert_close(losses.feature_matching_loss(tiny, t[:, :1]), [[1 - 1e-9 / (EPS * np.sqrt(14))]])


def test_gradients_reach_student_and_projection():
    s = jax.random.normal(jax.random.key(0), (2, 3, 4))
    t = jax.random.normal(jax.random.key(1), (2, 3, 5))
    w = jax.random.normal(jax.random.key(2), (4, 5))
    grad_s, grad_w, grad_t = jax.jit(
        jax.grad(
            lambda x, p, y: losses.feature_matching_loss(x, y, projection=p, metric="mse").sum(),
            argnums=(0, 1, 2),
        )
    )(s, w, t)
    # d/dW sum_t mean_j ((s W)_j - t_j)^2 = (2 / Dt) s^T (s W - t); likewise for s and t.
    residual = np.asarray(s, np.float64) @ np.asarray(w, np.float64) - np.asarray(t)
    flat_s = np.asarray(s, np.float64).reshape(-1, 4)
    assert_close(grad_w, 2 / 5 * flat_s.T @ residual.reshape(-1, 5), rtol=1e-5, atol=1e-5)
    assert_close(grad_s, 2 / 5 * residual @ np.asarray(w, np.float64).T, rtol=1e-5, atol=1e-5)
    assert_close(grad_t, -2 / 5 * residual, rtol=1e-5, atol=1e-6)
    # Cosine: the gradient w.r.t. the projected student is (t_hat - cos a_hat) / -|a|.
    a = np.asarray(s, np.float64) @ np.asarray(w, np.float64)
    a_hat = a / np.linalg.norm(a, axis=-1, keepdims=True)
    t_hat = np.asarray(t) / np.linalg.norm(t, axis=-1, keepdims=True)
    cos = (a_hat * t_hat).sum(-1, keepdims=True)
    grad_a = -(t_hat - cos * a_hat) / np.linalg.norm(a, axis=-1, keepdims=True)
    grad_w = jax.jit(jax.grad(lambda p: losses.feature_matching_loss(s, t, projection=p).sum()))(w)
    assert_close(grad_w, flat_s.T @ grad_a.reshape(-1, 5), rtol=1e-4, atol=1e-5)


def test_projection_trains_with_optax():
    s = jax.random.normal(jax.random.key(3), (2, 4, 3))
    true_w = jax.random.normal(jax.random.key(4), (3, 6))
    t = s @ true_w
    params = {"projection": jnp.zeros((3, 6))}
    optimizer = optax.adam(0.1)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(
            lambda p: losses.feature_matching_loss(
                s, t, projection=p["projection"], metric="mse"
            ).mean()
        )(params)
        updates, state = optimizer.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    first = None
    for _ in range(300):
        params, state, loss = step(params, state)
        first = loss if first is None else first
    assert float(first) > 1.0
    assert float(loss) < 1e-3 * float(first)
    assert_close(params["projection"], true_w, atol=0.05)


def test_masks():
    s = np.array(jax.random.normal(jax.random.key(5), (2, 4, 3)))
    t = np.array(jax.random.normal(jax.random.key(6), (2, 4, 5)))
    hs = np.array(jax.random.normal(jax.random.key(7), (2, 4, 2, 3)))
    ht = np.array(jax.random.normal(jax.random.key(8), (2, 4, 2, 5)))
    w = np.asarray(jax.random.normal(jax.random.key(9), (3, 5)))
    where = np.array([[True, True, False, False], [True, True, True, False]])
    s[0, 2:], t[0, 2:], hs[0, 2:], ht[0, 2:] = np.nan, np.inf, -np.inf, np.nan
    s[1, 3], ht[1, 3] = np.inf, np.nan

    @jax.jit
    def masked(x, y, hx, hy, p, m):
        return {
            metric: (
                losses.feature_matching_loss(x, y, projection=p, metric=metric, where=m),
                losses.attention_output_matching_loss(hx, hy, projection=p, metric=metric, where=m),
            )
            for metric in ("cosine", "mse")
        }

    out = masked(s, t, hs, ht, w, where)
    # An integer 0/1 mask counts like the boolean one.
    integer = masked(s, t, hs, ht, w, where.astype(np.int32))
    for metric, values in out.items():
        for value, same in zip(values, integer[metric], strict=True):
            np.testing.assert_array_equal(same, value)
    # Masked equals sliced: positions 0-1 of both rows.
    slices = [np.s_[:, :2]]
    sliced = [masked(s[part], t[part], hs[part], ht[part], w, None) for part in slices]
    for metric, values in out.items():
        for i, value in enumerate(values):
            assert np.all(np.asarray(value)[~where] == 0), metric
            for part, expected in zip(slices, sliced, strict=True):
                assert_close(value[part], expected[metric][i], rtol=1e-6)

    def total(x, y, hx, hy, p):
        return sum(v.sum() for pair in masked(x, y, hx, hy, p, where).values() for v in pair)

    grads = jax.jit(jax.grad(total, argnums=(0, 1, 2, 3, 4)))(s, t, hs, ht, w)
    for grad in grads:
        assert np.all(np.isfinite(grad))
    for grad in grads[:4]:
        assert np.all(np.asarray(grad)[~where] == 0)
    assert np.any(np.asarray(grads[4]) != 0)
    nothing = masked(s, t, hs, ht, w, np.zeros_like(where))
    assert all(np.all(np.asarray(v) == 0) for pair in nothing.values() for v in pair)


def test_bf16_and_float64():
    s = jax.random.normal(jax.random.key(10), (3, 5, 8))
    t = jax.random.normal(jax.random.key(11), (3, 5, 12))
    w = jax.random.normal(jax.random.key(12), (8, 12)) / 3
    hs = jax.random.normal(jax.random.key(16), (3, 5, 2, 8))
    ht = jax.random.normal(jax.random.key(17), (3, 5, 2, 12))
    low = both_metrics(*(x.astype(jnp.bfloat16) for x in (s, t, w, hs, ht)))
    full = both_metrics(s, t, w, hs, ht)
    for metric in ("cosine", "mse"):
        for lo, hi in zip(low[metric], full[metric], strict=True):
            assert lo.dtype == jnp.float32
            # bf16 inputs (2^-8 relative rounding) move these O(1) losses by < 0.02.
            assert_close(lo, hi, rtol=0.02, atol=0.02)
    with jax.enable_x64(True):
        s64, t64, w64 = (np.asarray(x, np.float64) for x in (s, t, w))
        out = losses.feature_matching_loss(s64, t64, projection=w64)
        assert out.dtype == jnp.float64
        assert_close(out, ref_feature(s64, t64, w64), rtol=1e-12, atol=1e-14)


def test_jit_vmap_and_no_retrace():
    hs = jax.random.normal(jax.random.key(13), (2, 3, 4, 5))
    ht = jax.random.normal(jax.random.key(14), (2, 3, 4, 6))
    w = jax.random.normal(jax.random.key(15), (5, 6))
    where = jnp.array([[True, True, False], [True, False, False]])
    expected = np.where(where, ref_attention(hs, ht, w), 0.0)
    jitted = jax.jit(losses.attention_output_matching_loss)
    assert_close(jitted(hs, ht, projection=w, where=where), expected, rtol=1e-5, atol=1e-6)
    mapped = jax.jit(
        jax.vmap(
            lambda x, y, m: losses.attention_output_matching_loss(
                x[None], y[None], projection=w, where=m[None]
            )[0]
        )
    )(hs, ht, where)
    assert_close(mapped, expected, rtol=1e-5, atol=1e-6)
    # New values (features, projection, mask) never retrace.
    assert_traced_once(
        losses.attention_output_matching_loss,
        [
            ((hs, ht), {"projection": w, "where": where}),
            ((2 * hs, ht + 1), {"projection": -w, "where": ~where}),
        ],
    )
    assert_traced_once(
        lambda x, y, p: losses.feature_matching_loss(x, y, projection=p, metric="mse"),
        [((hs[:, :, 0], ht[:, :, 0], p), {}) for p in (w, 2 * w)],
    )


def test_errors_name_the_argument():
    s, t = jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 5))
    w = jnp.zeros((4, 5))
    with raises_naming("projection"):
        losses.feature_matching_loss(s, t, projection=jnp.zeros((5, 4)))
    with raises_naming("teacher_outputs"):
        losses.attention_output_matching_loss(jnp.zeros((2, 3, 2, 4)), jnp.zeros((2, 3, 3, 5)))
    with raises_naming("where"):
        losses.feature_matching_loss(s, t, projection=w, where=jnp.ones((2, 3)))
    with own_checks():
        with raises_naming("projection", "(4, 5)", error=ValueError):
            losses.feature_matching_loss(s, t)
        with raises_naming("projection", "(5, 4)", "(4, 5)", error=ValueError):
            losses.feature_matching_loss(s, t, projection=jnp.zeros((5, 4)))
        with raises_naming("projection", error=TypeError):
            losses.feature_matching_loss(s, t, projection=jnp.zeros((4, 5), int))
        with raises_naming("teacher_features", "(2, 4, 5)", error=ValueError):
            losses.feature_matching_loss(s, jnp.zeros((2, 4, 5)), projection=w)
        with raises_naming("student_features", error=TypeError):
            losses.feature_matching_loss(jnp.zeros((2, 3, 4), int), t, projection=w)
        with raises_naming("metric", "cosine", error=ValueError):
            losses.feature_matching_loss(s, t, projection=w, metric="l2")
        with raises_naming("where", "(3, 2)", error=ValueError):
            losses.feature_matching_loss(s, t, projection=w, where=jnp.ones((3, 2), bool))
        with raises_naming(
            "student_outputs", "teacher_outputs", "N = 2", "N = 3", error=ValueError
        ):
            losses.attention_output_matching_loss(jnp.zeros((2, 3, 2, 4)), jnp.zeros((2, 3, 3, 5)))
        with raises_naming("teacher_outputs", "(2, 4, 2, 5)", error=ValueError):
            losses.attention_output_matching_loss(
                jnp.zeros((2, 3, 2, 4)), jnp.zeros((2, 4, 2, 5)), projection=w
            )
        with raises_naming("student_outputs", error=ValueError):
            losses.attention_output_matching_loss(jnp.zeros((3, 4)), jnp.zeros((3, 4)))
        with raises_naming("metric", error=ValueError):
            losses.attention_output_matching_loss(
                jnp.zeros((2, 3, 2, 4)), jnp.zeros((2, 3, 2, 4)), metric="cos"
            )
