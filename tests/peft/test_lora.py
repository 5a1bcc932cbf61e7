"""LoRA adapters: the forward against a float64 reference, on the decoder and on user models."""

import functools
import warnings

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings

from tests._helpers import assert_traced_once, raises_naming
from tunelib import peft
from tunelib.models import Decoder, DecoderConfig, param_shardings

CONFIG = dict(
    vocab_size=32,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
    use_qk_norm=True,
    attention_bias=True,
)
TOKENS = jnp.array([[3, 17, 9, 30, 1, 22], [5, 5, 12, 0, 31, 7]])
WHERE = jnp.array([[True] * 6, [True] * 4 + [False] * 2])
ALL_PROJECTIONS = [peft.LoraRule(pattern=r".*_proj/kernel", rank=4, alpha=8)]


@functools.cache
def _decoder(overrides: tuple):
    """Made abstractly, then drawn in NumPy as the initialisers would (N(0, 0.02) weights,
    unit norm scales, zero biases): no initialiser is compiled."""
    config = DecoderConfig(**{**CONFIG, **dict(overrides)})
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)

    def draw(path, x):
        name = path[-1].key
        if name == "scale":
            return jnp.ones(x.shape, x.dtype)
        if name == "bias":
            return jnp.zeros(x.shape, x.dtype)
        return jnp.asarray(config.initializer_range * rng.standard_normal(x.shape), x.dtype)

    return graphdef, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state))


def decoder(**overrides):
    """The test decoder's graph definition and parameters (built once per configuration)."""
    return _decoder(tuple(sorted(overrides.items())))


def trained(adapters, seed=7, size=0.1):
    """Adapters with random non-zero factors, as after some training."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(size * rng.standard_normal(x.shape), x.dtype), adapters
    )


# Module-level jitted forwards, keyed on the (static) graph definition: every test that runs
# the same decoder reuses one compilation.
@functools.partial(jax.jit, static_argnums=0)
def run_lora(graphdef, params, adapters, dropout_key=None):
    def forward(p, tokens):
        return nnx.merge(graphdef, p)(tokens, where=WHERE)

    weights = peft.apply_lora(params, adapters, dropout_key=dropout_key)
    return peft.lora(forward)(weights, TOKENS)


@functools.partial(jax.jit, static_argnums=0)
def run_dense(graphdef, params):
    return nnx.merge(graphdef, params)(TOKENS, where=WHERE)


merge_lora = jax.jit(peft.merge_lora)
unmerge_lora = jax.jit(peft.unmerge_lora)
_init_adapters = jax.jit(peft.init_lora, static_argnames="rules")


def init_adapters(params, rules=ALL_PROJECTIONS):
    """`peft.init_lora` with key 1, compiled once per decoder (not one draw at a time)."""
    return _init_adapters(params, tuple(rules), key=jax.random.key(1))


# ----------------------------------------------------------------------------- the product


def reference(x, w, a, b, scale):
    """x W + s (x A) B in float64."""
    x, w, a, b = (np.asarray(t, np.float64) for t in (x, w, a, b))
    return x @ w + scale * (x @ a) @ b


FORMS = {
    "matmul": lambda p, x: x @ p["w"],
    "einsum": lambda p, x: jnp.einsum("mi,io->mo", x, p["w"]),
    "left": lambda p, x: (p["w"].T @ x.T).T,
    "transposed": lambda p, x: x @ p["w"].T.T,
    "dot_general_left": lambda p, x: jax.lax.dot_general(p["w"], x, (((0,), (1,)), ((), ()))).T,
}


@jax.jit
def every_form(x, w, a, b):
    """Each form of the product under `lora`, one compilation per shape (a warning, which
    `lora` gives while tracing, still reaches the caller)."""
    weight = peft.apply_lora({"w": w}, {"w": peft.LoraAdapter(a=a, b=b, alpha=3.0)})
    return {name: peft.lora(fn)(weight, x) for name, fn in FORMS.items()}


@settings(max_examples=10)
@given(
    m=st.integers(1, 5),
    d0=st.integers(1, 9),
    d1=st.integers(1, 9),
    rank=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_products_equal_the_float64_reference(m, d0, d1, rank, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d0)).astype(np.float32)
    w = rng.standard_normal((d0, d1)).astype(np.float32)
    a = rng.standard_normal((d0, rank)).astype(np.float32)
    b = rng.standard_normal((rank, d1)).astype(np.float32)
    expected = reference(x, w, a, b, 3.0 / rank)
    with warnings.catch_warnings():
        warnings.simplefilter("error", peft.MaterializationWarning)
        outs = every_form(x, w, a, b)
    for name, out in outs.items():
        np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5, err_msg=name)


def test_stacked_weights_under_scan_and_batched_products():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 6, 5)).astype(np.float32)
    a = rng.standard_normal((3, 6, 2)).astype(np.float32)
    b = rng.standard_normal((3, 2, 5)).astype(np.float32)
    x = rng.standard_normal((3, 4, 6)).astype(np.float32)
    weight = peft.apply_lora({"w": w}, {"w": peft.LoraAdapter(a=a, b=b, alpha=2.0)})
    expected = np.stack([reference(x[i], w[i], a[i], b[i], 1.0) for i in range(3)])

    def scanned(p, x):
        return jax.lax.scan(lambda c, wx: (c, wx[1] @ wx[0]), 0.0, (p["w"], x))[1]

    def batched(p, x):
        return jnp.einsum("lmi,lio->lmo", x, p["w"])

    for fn in (scanned, batched):
        np.testing.assert_allclose(peft.lora(fn)(weight, x), expected, rtol=2e-5, atol=2e-5)


def test_other_operations_materialise_with_a_warning():
    w, a, b = jnp.ones((3, 2)), jnp.ones((3, 1)), jnp.ones((1, 2))
    weight = peft.apply_lora({"w": w}, {"w": peft.LoraAdapter(a=a, b=b, alpha=1.0)})
    with pytest.warns(peft.MaterializationWarning, match="shape"):
        out = peft.lora(lambda p: p["w"].reshape(-1) * 2)(weight)
    np.testing.assert_array_equal(out, np.full(6, 4.0))


# ----------------------------------------------------------------------------- the decoder


@pytest.mark.parametrize("scan_layers", [False, True])
def test_zero_b_gives_the_base_outputs_bit_for_bit(scan_layers):
    graphdef, params = decoder(scan_layers=scan_layers)
    adapters = init_adapters(params)
    base = run_dense(graphdef, params)
    np.testing.assert_array_equal(run_lora(graphdef, params, adapters), base)
    # Dropout sees only the adapter's input, so with B = 0 it changes nothing either.
    dropped = [dict(rule.__dict__, dropout=0.5) for rule in ALL_PROJECTIONS]
    with_dropout = init_adapters(params, [peft.LoraRule(**r) for r in dropped])
    out = run_lora(graphdef, params, with_dropout, dropout_key=jax.random.key(2))
    np.testing.assert_array_equal(out, base)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_merged_and_unmerged_forwards_agree(scan_layers):
    """In float64, where x W + s (x A) B and x (W + s A B) agree to rounding: in float32 their
    orders of summation moved hidden states of 3 by 3e-6 here, by how much depending on the
    CPU."""
    with jax.enable_x64(True):
        graphdef, params = decoder(scan_layers=scan_layers, dtype="float64", param_dtype="float64")
        adapters = trained(init_adapters(params))
        unmerged = run_lora(graphdef, params, adapters)
        merged = run_dense(graphdef, merge_lora(params, adapters))
        base = run_dense(graphdef, params)
        restored = unmerge_lora(merge_lora(params, adapters), adapters)
    assert unmerged.dtype == merged.dtype == jnp.float64
    assert np.abs(np.asarray(unmerged) - np.asarray(base)).max() > 0.1  # the adapters change it
    np.testing.assert_allclose(unmerged, merged, rtol=1e-12, atol=1e-12)
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-15)


def test_bf16_compute_is_close_to_float32():
    graphdef, params = decoder()
    adapters = trained(init_adapters(params))
    graphdef16, _ = decoder(dtype="bfloat16")
    out16 = run_lora(graphdef16, params, adapters)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        out16.astype(np.float32), run_lora(graphdef, params, adapters), atol=0.1, rtol=0.05
    )


def test_gradients_flow_into_adapters_only():
    graphdef, params = decoder()
    adapters = init_adapters(params)

    def loss(adapters, params):
        out = peft.lora(lambda p: nnx.merge(graphdef, p)(TOKENS, where=WHERE))(
            peft.apply_lora(params, adapters)
        )
        return jnp.sum(out[..., :8] ** 2)

    grads = jax.jit(jax.grad(loss))(adapters, params)
    for adapter in jax.tree.leaves(grads, is_leaf=lambda x: isinstance(x, peft.LoraAdapter)):
        # At B = 0 the gradient of A is exactly zero (it is multiplied by B); B's is not.
        np.testing.assert_array_equal(adapter.a, 0.0)
        assert float(jnp.abs(adapter.b).max()) > 0


def test_labels_freeze_the_base_under_optax_partition():
    """One tree holding base and adapters, labelled for optax.partition: the base never moves."""
    params = {"w1": jnp.ones((4, 8)) / 4, "w2": jnp.ones((8, 2)) / 8, "norm": jnp.ones(4)}
    rules = [peft.LoraRule(pattern=r"w\d", rank=2)]
    adapters = trained(peft.init_lora(params, rules, key=jax.random.key(0)))
    x = jnp.linspace(-1, 1, 12).reshape(3, 4)

    def loss(tree):
        def mlp(p):
            return jnp.tanh((x * p["norm"]) @ p["w1"]) @ p["w2"]

        return jnp.sum(peft.lora(mlp)(peft.apply_lora(tree["base"], tree["lora"])) ** 2)

    tree = {"base": params, "lora": adapters}
    labels = peft.lora_labels(tree)
    assert labels["base"]["w1"] == "frozen" and labels["lora"]["w1"].a == "lora"
    optimizer = optax.partition({"lora": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)

    @jax.jit
    def step(tree):
        updates, _ = optimizer.update(jax.grad(loss)(tree), optimizer.init(tree), tree)
        return optax.apply_updates(tree, updates)

    new = step(tree)
    for after, before in zip(jax.tree.leaves(new["base"]), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(after, before)
    for after, before in zip(jax.tree.leaves(new["lora"]), jax.tree.leaves(adapters), strict=True):
        assert not np.array_equal(after, before)
    mask = peft.lora_mask(tree)
    assert not any(jax.tree.leaves(mask["base"])) and all(jax.tree.leaves(mask["lora"]))


def test_dropout_is_inverted_and_keyed():
    w = jnp.zeros((8, 4))
    adapter = peft.LoraAdapter(a=jnp.ones((8, 1)), b=jnp.ones((1, 4)), alpha=1.0, dropout=0.5)
    x = jnp.ones((256, 8))

    @jax.jit
    def out(key):
        return peft.lora(lambda p: x @ p["w"])(
            peft.apply_lora({"w": w}, {"w": adapter}, dropout_key=key)
        )

    plain = out(None)
    np.testing.assert_allclose(plain, 8.0)
    one, same, other = out(jax.random.key(0)), out(jax.random.key(0)), out(jax.random.key(1))
    np.testing.assert_array_equal(one, same)
    assert not np.array_equal(one, other)
    # Each output is 2 x (number of kept inputs of 8): mean 8, values even.
    np.testing.assert_allclose(float(one.mean()), 8.0, rtol=0.05)
    np.testing.assert_array_equal(np.asarray(one) % 2, 0)


def test_second_call_with_new_adapters_does_not_retrace():
    graphdef, params = decoder()
    adapters = init_adapters(params)

    def forward(params, adapters):
        fn = peft.lora(lambda p: nnx.merge(graphdef, p)(TOKENS, where=WHERE))
        return fn(peft.apply_lora(params, adapters))

    assert_traced_once(forward, [((params, adapters), {}), ((params, trained(adapters)), {})])


def test_sharded_over_8_devices_equals_one_device():
    """In float64: the sharded products sum partial results in another order, which moves
    float32 hidden states by a CPU-dependent rounding (1.4e-6 here)."""
    with jax.enable_x64(True):
        graphdef, params = decoder(dtype="float64", param_dtype="float64")
        adapters = trained(init_adapters(params))
        expected = run_lora(graphdef, params, adapters)
        mesh = jax.make_mesh(
            (2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
        )
        sharded = jax.device_put(params, param_shardings(graphdef, params, mesh))
        replicated = jax.device_put(adapters, jax.sharding.NamedSharding(mesh, jax.P()))
        out = run_lora(graphdef, sharded, replicated)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- user models


def test_a_plain_jax_function_and_an_nnx_module_unchanged():
    def mlp(params, x):  # a user's function in the PyTorch layout: y = x W^T
        return jax.nn.gelu(x @ params["fc1"]["weight"].T) @ params["fc2"]["weight"].T

    @jax.jit
    def adapted_plain_and_merged(params, adapters, x):
        adapted = peft.lora(mlp)(peft.apply_lora(params, adapters), x)
        return adapted, mlp(params, x), mlp(peft.merge_lora(params, adapters), x)

    rng = np.random.default_rng(0)
    params = {
        "fc1": {"weight": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)},
        "fc2": {"weight": jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)},
    }
    rules = [peft.LoraRule(pattern=r"fc\d/weight", rank=2, alpha=4, layout="out_in")]
    adapters = peft.init_lora(params, rules, key=jax.random.key(0))
    assert float(jnp.abs(adapters["fc1"]["weight"].a).max()) == 0  # the output-side factor
    x = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
    adapted, plain, _ = adapted_plain_and_merged(params, adapters, x)
    np.testing.assert_array_equal(adapted, plain)
    adapted, _, merged = adapted_plain_and_merged(params, trained(adapters), x)
    np.testing.assert_allclose(adapted, merged, rtol=1e-5, atol=1e-5)

    class Net(nnx.Module):  # a user's NNX module built from Flax layers
        def __init__(self, rngs):
            self.up = nnx.Linear(8, 16, rngs=rngs)
            self.down = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    graphdef, state = nnx.split(Net(nnx.Rngs(0)))
    state = nnx.to_pure_dict(state)
    adapters = trained(
        peft.init_lora(state, [peft.LoraRule(pattern=r".*/kernel", rank=2)], key=jax.random.key(0))
    )

    @jax.jit
    def adapted_and_merged_net(state, adapters, x):
        adapted = peft.lora(lambda s, x: nnx.merge(graphdef, s)(x))(
            peft.apply_lora(state, adapters), x
        )
        return adapted, nnx.merge(graphdef, peft.merge_lora(state, adapters))(x)

    out, merged = adapted_and_merged_net(state, adapters, x)
    np.testing.assert_allclose(out, merged, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- rules and init


def test_rules_first_match_wins_and_unmatched_rules_are_errors():
    _, params = decoder()
    rules = [
        peft.LoraRule(pattern=r"layers/0/self_attn/q_proj/kernel", rank=2),
        peft.LoraRule(pattern=r".*q_proj/kernel", rank=4),
    ]
    adapters = peft.init_lora(params, rules, key=jax.random.key(0))
    assert adapters["layers"][0]["self_attn"]["q_proj"]["kernel"].rank == 2
    assert adapters["layers"][1]["self_attn"]["q_proj"]["kernel"].rank == 4
    assert set(adapters["layers"][0]["self_attn"]) == {"q_proj"}
    with raises_naming("nothing", "mlp/missing_proj"):
        peft.init_lora(params, [peft.LoraRule(pattern="mlp/missing_proj")], key=jax.random.key(0))
    shadowed = [peft.LoraRule(pattern=r".*_proj/kernel"), peft.LoraRule(pattern=r".*q_proj/kernel")]
    with raises_naming("earlier", "q_proj"):
        peft.init_lora(params, shadowed, key=jax.random.key(0))
    with pytest.warns(peft.UnmatchedRuleWarning):
        peft.init_lora(params, shadowed, key=jax.random.key(0), allow_unmatched=True)
    with raises_naming("norm/scale", "2 or more dimensions"):
        peft.init_lora(params, [peft.LoraRule(pattern="norm/scale")], key=jax.random.key(0))
    with raises_naming("rank"):
        peft.LoraRule(pattern="x", rank=0)
    with raises_naming("dropout"):
        peft.LoraRule(pattern="x", dropout=1.0)
    with raises_naming("pattern"):
        peft.LoraRule(pattern="(unclosed")


def test_adapters_that_do_not_fit_the_weights_are_errors():
    params = {"w": jnp.ones((4, 3))}
    with raises_naming("'v'"):
        peft.apply_lora(params, {"v": peft.LoraAdapter(a=jnp.ones((4, 1)), b=jnp.ones((1, 3)))})
    with raises_naming("'w'", "(4, 3)"):
        peft.apply_lora(params, {"w": peft.LoraAdapter(a=jnp.ones((3, 1)), b=jnp.ones((1, 3)))})


def test_initialisation_follows_peft():
    params = {"w": jnp.ones((2, 512, 256))}  # stacked: one adapter per leading index
    kaiming = peft.init_lora(
        params, [peft.LoraRule(pattern="w", rank=16, alpha=32)], key=jax.random.key(0)
    )
    a = np.asarray(kaiming["w"].a)
    bound = 1 / np.sqrt(512)
    assert a.shape == (2, 512, 16) and np.abs(a).max() <= bound
    np.testing.assert_allclose(a.std(), bound / np.sqrt(3), rtol=0.03)  # U(-b, b) has std b/sqrt 3
    assert not np.array_equal(a[0], a[1])
    np.testing.assert_array_equal(kaiming["w"].b, 0.0)
    assert kaiming["w"].scale == 2.0
    rule = peft.LoraRule(pattern="w", rank=16, alpha=32, init="gaussian", scaling="rslora")
    gaussian = peft.init_lora(params, [rule], key=jax.random.key(0))["w"]
    np.testing.assert_allclose(np.asarray(gaussian.a).std(), 1 / 16, rtol=0.03)
    assert gaussian.scale == 32 / 4


def test_remat_and_custom_vjp_regions_keep_the_weights_adapted():
    """`remat=True` layers and the fused log-prob head (a custom VJP) inside `lora(fn)`:
    nothing is materialised, and values and gradients equal those of merged weights."""
    from tunelib import logprobs

    targets = jnp.roll(TOKENS, -1, axis=1)
    graphdef, params = decoder(scan_layers=True, remat=True)
    adapters = trained(init_adapters(params))
    base = jax.jit(lambda p: peft.quantize_params(p, [r".*_proj/kernel"]))(params)

    def loss(params):
        model = nnx.merge(graphdef, params)
        hidden = model(TOKENS, where=WHERE)
        token = logprobs.fused_token_logps(hidden, model.unembedding(), targets, where=WHERE)
        return -token.sum()

    @jax.jit
    def adapted(adapters, base):
        return jax.value_and_grad(lambda a: peft.lora(loss)(peft.apply_lora(base, a)))(adapters)

    @jax.jit
    def merged(adapters, base):
        return jax.value_and_grad(lambda a: loss(peft.merge_lora(base, a)))(adapters)

    with warnings.catch_warnings():
        warnings.simplefilter("error", peft.MaterializationWarning)
        for frozen in (params, base):
            dense = jax.jit(peft.dequantize_params)(frozen)
            got, want = adapted(adapters, frozen), merged(adapters, dense)
            np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
            # Gradients on the scale of each leaf: float32 rounding of the two orders of the
            # products leaves errors of about 2e-6 of the leaf's largest entry (up to 2).
            for x, y in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5 * np.abs(y).max())
