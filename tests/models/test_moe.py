"""The mixture-of-experts layer: grouped products, routing, the layer, Qwen3-MoE parity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import assume, given
from hypothesis import strategies as st

from tests._helpers import assert_close, assert_traced_once, own_checks, raises_naming
from tests._hf import hf_logits, hf_modules, model_class, write_tiny_checkpoint
from tests.losses.test_router import softmax64
from tunelib import losses
from tunelib.formats import load_hf_checkpoint
from tunelib.models import (
    EXPERT_PARALLEL_RULES,
    Decoder,
    DecoderConfig,
    MoE,
    grouped_matmul,
    param_shardings,
    route,
)

IMPLEMENTATIONS = ("blocked", "ragged_dot")


def grouped_reference(x, w, sizes):
    """Row runs times their group's matrix, group by group in float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for g, n in enumerate(sizes):
        out[start : start + n] = x[start : start + n] @ w[g]
        start += n
    return out


@jax.jit(static_argnames=("implementation", "block"))
def _grouped_value_and_grads(x, w, sizes, ct, implementation, block):
    """One compiled program per shape and setting: the examples' value and both gradients."""

    def f(x, w):
        out = grouped_matmul(x, w, sizes, implementation=implementation, block_size=block)
        return jnp.sum(out * ct), out

    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, w)


@given(
    st.lists(st.integers(0, 12), min_size=1, max_size=5),
    st.integers(0, 4),
    st.sampled_from(IMPLEMENTATIONS),
    st.sampled_from([None, 1, 4]),
)
def test_grouped_matmul_equals_the_float64_reference(sizes, spare, implementation, block):
    """Values and both gradients, empty groups and rows past the last group included."""
    rng = np.random.default_rng(sum(sizes) + spare)
    m, k, n = sum(sizes) + spare, 3, 2
    x = rng.normal(size=(max(m, 1), k))
    w = rng.normal(size=(len(sizes), k, n))
    ct = rng.normal(size=(max(m, 1), n))
    sizes = np.array(sizes, np.int32)
    with jax.enable_x64(True):
        (_, out), (dx, dw) = _grouped_value_and_grads(x, w, sizes, ct, implementation, block)
    assert_close(out, grouped_reference(x, w, sizes), rtol=1e-12, atol=1e-12)
    expected_dx, expected_dw, start = np.zeros_like(x), np.zeros_like(w), 0
    for g, count in enumerate(sizes):
        rows = slice(start, start + count)
        expected_dx[rows] = ct[rows] @ w[g].T
        expected_dw[g] = x[rows].T @ ct[rows]
        start += count
    assert_close(dx, expected_dx, rtol=1e-12, atol=1e-12)
    assert_close(dw, expected_dw, rtol=1e-12, atol=1e-12)


def test_grouped_matmul_jvp_vmap_dtypes_and_one_compilation():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 4)).astype(np.float32)
    w = rng.normal(size=(3, 4, 5)).astype(np.float32)
    sizes = np.array([4, 0, 5], np.int32)
    expected = grouped_reference(x, w, sizes)
    for implementation in IMPLEMENTATIONS:
        run = lambda x, w, impl=implementation: grouped_matmul(x, w, sizes, implementation=impl)  # noqa: E731
        _, tangent = jax.jvp(run, (x, w), (x, np.zeros_like(w)))
        assert_close(tangent, expected, rtol=1e-5, atol=1e-5)
        batched = jax.vmap(run, in_axes=(0, None))(np.stack([x, -x]), w)
        assert_close(batched[1], -expected, rtol=1e-5, atol=1e-5)
        low = run(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
        assert low.dtype == jnp.bfloat16
        assert_close(low, expected, rtol=5e-2, atol=5e-2)
        calls = [((x, w, s), {}) for s in (sizes, np.array([1, 8, 1], np.int32))]
        assert_traced_once(
            lambda x, w, s, impl=implementation: grouped_matmul(x, w, s, implementation=impl), calls
        )


def test_grouped_matmul_errors():
    x, w = np.ones((4, 3), np.float32), np.ones((2, 3, 5), np.float32)
    with own_checks():
        with raises_naming("x", "w", "group_sizes"):
            grouped_matmul(x, w[:, :2], np.array([2, 2]))
        with raises_naming("x", "w", "group_sizes"):
            grouped_matmul(x, w, np.array([2, 1, 1]))
        with raises_naming("implementation", "blocked"):
            grouped_matmul(x, w, np.array([2, 2]), implementation="loop")
        with raises_naming("block_size"):
            grouped_matmul(x, w, np.array([2, 2]), block_size=0)
        with raises_naming("group_sizes", error=TypeError):
            grouped_matmul(x, w, np.array([2.0, 2.0]))


def test_blocked_is_refused_on_a_tpu_and_auto_is_ragged_dot_there(monkeypatch):
    x, w, sizes = np.ones((4, 3), np.float32), np.ones((2, 3, 5), np.float32), np.array([2, 2])
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with raises_naming("blocked", "TPU", "ragged_dot"):
        grouped_matmul(x, w, sizes, implementation="blocked")
    jaxpr = jax.make_jaxpr(lambda x: grouped_matmul(x, w, sizes))(x)
    assert "implementation=ragged_dot" in str(jaxpr)


@given(st.integers(1, 6), st.booleans(), st.integers(0, 10**6))
def test_route_is_softmax_top_k(top_k, normalize, seed):
    logits = np.random.default_rng(seed).normal(size=(5, 6)).astype(np.float32) * 3
    # Two distinct logits within float32 rounding of each other at the top-k boundary are
    # ordered by float32's softmax (a few 1e-7 relative), not the formula: such draws are left
    # out (a gap of 1e-5 is decided by the formula). Exact ties agree: lower index first.
    ranked = -np.sort(-logits.astype(np.float64), axis=-1)
    gap = ranked[:, top_k - 1] - ranked[:, top_k] if top_k < 6 else np.zeros(1)
    assume(np.all((gap == 0) | (gap > 1e-5)))
    weights, experts = route(logits, top_k=top_k, norm_topk_prob=normalize)
    p = softmax64(logits)
    order = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    np.testing.assert_array_equal(experts, order)
    chosen = np.take_along_axis(p, order, axis=-1)
    if normalize:
        chosen = chosen / chosen.sum(-1, keepdims=True)
    assert_close(weights, chosen, rtol=1e-5, atol=1e-7)
    with own_checks(), raises_naming("top_k", "[1, 6]"):
        route(logits, top_k=7)


CONFIG = dict(
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=12,
    initializer_range=0.5,
)


def moe_reference(params, x, top_k, normalize):
    """The layer's formula token by token in float64: sum over chosen experts of w_e * MLP_e."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    out, logits = np.zeros_like(x, np.float64), x @ p["router"]
    for t, row in enumerate(np.asarray(x, np.float64)):
        probs = softmax64(logits[t])
        chosen = np.argsort(-probs, kind="stable")[:top_k]
        weights = probs[chosen] / (probs[chosen].sum() if normalize else 1.0)
        for e, weight in zip(chosen, weights, strict=True):
            g, u = row @ p["gate"][e], row @ p["up"][e]
            out[t] += weight * ((g / (1 + np.exp(-g)) * u) @ p["down"][e])
    return out, logits


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("normalize", [False, True])
def test_moe_layer_equals_its_formula_and_a_dense_dispatch(implementation, normalize):
    """In float64: the grouped products, the formula token by token and the dense dispatch sum
    in different orders, which in float32 moves gradients of 20 by up to 6e-6 here (and by
    how much depends on the CPU); in float64 they agree to rounding."""
    with jax.enable_x64(True):
        config = DecoderConfig(**CONFIG, norm_topk_prob=normalize, dtype="float64",
                               param_dtype="float64")  # fmt: skip
        layer = MoE(config, implementation=implementation, rngs=nnx.Rngs(0))
        x = np.random.default_rng(1).normal(size=(3, 7, 16))
        out, logits = layer(jnp.asarray(x))
        e = layer.experts
        params = {
            "router": layer.gate.kernel[...],
            "gate": e["gate_proj"].kernel[...],
            "up": e["up_proj"].kernel[...],
            "down": e["down_proj"].kernel[...],
        }
    assert out.shape == (3, 7, 16) and logits.shape == (3, 7, 4)
    assert out.dtype == logits.dtype == jnp.float64
    expected, expected_logits = moe_reference(params, x.reshape(-1, 16), 2, normalize)
    # No token has two experts at the top-2 boundary within rounding of each other: the
    # formula, not rounding, picks every expert here.
    ranked = -np.sort(-expected_logits, axis=-1)
    assert np.min(ranked[:, 1] - ranked[:, 2]) > 1e-6
    assert_close(out.reshape(-1, 16), expected, rtol=1e-12, atol=1e-12)
    assert_close(logits.reshape(-1, 4), expected_logits, rtol=1e-12, atol=1e-12)

    def dense(params, x):
        """Every token through every expert, weighted by a one-hot of its choices."""
        weights, chosen = route(x @ params["router"], top_k=2, norm_topk_prob=normalize)
        gates = jnp.sum(jax.nn.one_hot(chosen, 4) * weights[..., None], axis=-2)  # [N, E]
        hidden = jax.nn.silu(jnp.einsum("nh,ehf->nef", x, params["gate"]))
        hidden = hidden * jnp.einsum("nh,ehf->nef", x, params["up"])
        return jnp.einsum("nef,efh,ne->nh", hidden, params["down"], gates)

    graphdef, state = nnx.split(layer)

    def ours(params, x):
        pure = nnx.to_pure_dict(state)
        pure["gate"]["kernel"] = params["router"]
        for name, key in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            pure["experts"][name]["kernel"] = params[key]
        return nnx.merge(graphdef, pure)(x.reshape(3, 7, 16))[0].reshape(-1, 16)

    ct = np.random.default_rng(2).normal(size=(21, 16))
    flat = x.reshape(-1, 16)
    with jax.enable_x64(True):
        grads = jax.grad(lambda p, x: jnp.sum(ours(p, x) * ct), argnums=(0, 1))(params, flat)
        expected = jax.grad(lambda p, x: jnp.sum(dense(p, x) * ct), argnums=(0, 1))(params, flat)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        assert got.dtype == jnp.float64
        assert_close(got, want, rtol=1e-10, atol=1e-12 * float(np.abs(want).max()))


def test_layer_kinds_scan_and_config_errors():
    config = DecoderConfig(**{**CONFIG, "num_hidden_layers": 4}, decoder_sparse_step=2,
                           mlp_only_layers=[3])  # fmt: skip
    assert config.moe_layers == (False, True, False, False)
    assert config.mlp_only_layers == (3,)
    model = Decoder(config, rngs=nnx.Rngs(0))
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["MLP", "MoE", "MLP", "MLP"]
    hidden, router_logits = model(np.ones((2, 3), np.int32), return_router_logits=True)
    assert hidden.shape == (2, 3, 16) and router_logits.shape == (1, 2, 3, 4)
    scanned = Decoder(DecoderConfig(**CONFIG, scan_layers=True), rngs=nnx.Rngs(0))
    assert scanned(np.ones((2, 3), np.int32), return_router_logits=True)[1].shape == (2, 2, 3, 4)
    dense = Decoder(DecoderConfig(**{**CONFIG, "num_experts": 0}), rngs=nnx.Rngs(0))
    assert dense(np.ones((2, 3), np.int32), return_router_logits=True)[1].shape == (0, 2, 3, 1)
    with raises_naming("num_experts_per_tok", "num_experts"):
        DecoderConfig(**{**CONFIG, "num_experts_per_tok": 5})
    # Dense and mixture-of-experts layers are scanned by groups (`test_layer_groups`).
    mixed = DecoderConfig(**CONFIG, mlp_only_layers=[0], scan_layers=True)
    mixed = Decoder(mixed, rngs=nnx.Rngs(0))
    assert mixed(np.ones((2, 3), np.int32), return_router_logits=True)[1].shape == (1, 2, 3, 4)
    with raises_naming("mlp_only_layers"):
        DecoderConfig(**CONFIG, mlp_only_layers=[2])


def expert_parallel_equals_one_device(graphdef, params, tokens, kernel, **tolerance):
    """Loss (with the auxiliary loss) and gradients on 8 devices, experts over "expert" (4)
    and widths over "model" (2), equal one device's; `kernel(shardings)` picks an expert
    kernel's sharding, which must split experts and width. Returns one device's gradients."""

    def loss(params, tokens):
        model = nnx.merge(graphdef, params)
        hidden, router_logits = model(tokens, return_router_logits=True)
        aux = losses.load_balancing_loss(router_logits, top_k=2)
        return jnp.mean(model.unembed(hidden) ** 2) + 0.1 * aux

    step = jax.jit(jax.value_and_grad(loss))
    single = step(params, tokens)
    auto = (jax.sharding.AxisType.Auto,) * 3
    mesh = jax.make_mesh((1, 4, 2), ("data", "expert", "model"), axis_types=auto)
    shardings = param_shardings(graphdef, params, mesh, EXPERT_PARALLEL_RULES)
    assert kernel(shardings).spec == jax.sharding.PartitionSpec("expert", None, "model")
    sharded = step(jax.device_put(params, shardings), tokens)
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
        assert_close(got, want, **tolerance)
    return single[1]


def test_expert_parallel_sharding_equals_one_device():
    """In float64, as Gemma 4's below: in float32 the sharded products' other order of
    summation moved gradients of 0.4 by up to 9e-7 here, 0.8 of the tolerance this test had,
    and by how much depends on the CPU."""
    with jax.enable_x64(True):
        config = DecoderConfig(**{**CONFIG, "num_experts": 8, "num_attention_heads": 4},
                               dtype="float64", param_dtype="float64")  # fmt: skip
        graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
        tokens = np.random.default_rng(0).integers(0, 40, size=(4, 6))
        grads = expert_parallel_equals_one_device(
            graphdef, params, tokens,
            lambda s: s["layers"][0]["mlp"]["experts"]["gate_proj"]["kernel"],
            rtol=1e-10, atol=1e-12,
        )  # fmt: skip
    assert all(g.dtype == jnp.float64 for g in jax.tree.leaves(grads))


def test_qwen3_moe_layer_kinds_routing_and_aux_loss_match_transformers(tmp_path):
    """Sparse step 2 with a dense layer forced: logits, each token's experts, and the
    auxiliary loss equal transformers' (its `aux_loss` over a padded batch)."""
    torch, _ = hf_modules()
    directory = write_tiny_checkpoint(
        tmp_path / "hf", "qwen3_moe", tokenizer=False, num_hidden_layers=4,
        decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False,
    )  # fmt: skip
    reference = model_class("qwen3_moe").from_pretrained(directory).eval()
    loaded = load_hf_checkpoint(directory)
    assert loaded.config.moe_layers == (False, True, False, False)
    tokens = np.random.default_rng(0).integers(4, 300, size=(3, 9))
    where = np.ones(tokens.shape, bool)
    where[0, :3] = False
    where[1, -2:] = False
    model = nnx.merge(loaded.graphdef, loaded.params)
    hidden, router_logits = model(tokens, where=where, return_router_logits=True)
    expected = hf_logits(reference, tokens, where)
    assert np.abs(np.asarray(model.unembed(hidden)) - expected)[where].max() < 1e-4
    with torch.no_grad():
        out = reference(
            input_ids=torch.tensor(np.where(where, tokens, 0)),
            attention_mask=torch.tensor(where.astype(np.int64)),
            output_router_logits=True,
        )
    (theirs,) = out.router_logits  # one sparse layer
    theirs = theirs.numpy().reshape(3, 9, -1)
    assert np.abs(np.asarray(router_logits[0]) - theirs)[where].max() < 1e-5
    # No token is a near tie that float32 rounding could route either way: the second and
    # third of our logits are further apart than twice their distance to transformers'.
    ranked = -np.sort(-np.asarray(router_logits[0]), axis=-1)[where]
    assert np.min(ranked[:, 1] - ranked[:, 2]) > 2e-5
    chosen = np.asarray(route(router_logits[0], top_k=2)[1])
    their_chosen = torch.topk(torch.softmax(torch.tensor(theirs), -1), 2).indices.numpy()
    np.testing.assert_array_equal(chosen[where], their_chosen[where])
    aux = losses.load_balancing_loss(router_logits, top_k=2, where=where)
    assert_close(aux, float(out.aux_loss), rtol=1e-5)


def test_checkpoint_with_another_expert_count_names_the_tensor(tmp_path):
    hf_modules()
    directory = write_tiny_checkpoint(tmp_path / "hf", "qwen3_moe", tokenizer=False)
    config = directory / "config.json"
    config.write_text(config.read_text().replace('"num_local_experts": 4', '"num_experts": 3'))
    with raises_naming("unexpected", "model.layers.0.mlp.experts.3.down_proj.weight"):
        load_hf_checkpoint(directory)
