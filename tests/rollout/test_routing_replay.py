"""Routing replay (R3): the sampler (`sample`, and `run_episodes` over whole episodes) records
each token's experts in every MoE layer, and the trainer's forward pass (`Decoder`,
`completion_logps`) routes by that record while its gate weights stay functions of its own
router logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import assert_close, own_checks, raises_naming
from tests.losses.test_router import softmax64
from tests.models.test_gemma4 import MOE as GEMMA4_MOE
from tests.models.test_moe import CONFIG as MOE_CONFIG
from tests.rollout.test_episodes import Scripted
from tunelib.models import EXPERT_PARALLEL_RULES, Decoder, DecoderConfig, MoE, param_shardings
from tunelib.rollout import (
    EpisodeConfig,
    Role,
    SamplingConfig,
    completion_logps,
    run_episodes,
    sample,
)

CONFIG = {**MOE_CONFIG, "norm_topk_prob": True}  # 2 layers, 4 experts, top-2
PROMPTS = np.array([[0, 0, 5, 9, 3], [7, 1, 4, 4, 8]])
PROMPT_WHERE = np.array([[False, False, True, True, True], [True] * 5])
SAMPLING = SamplingConfig(max_new_tokens=6, temperature=1.0, stop_tokens=(2,))

score = jax.jit(completion_logps, static_argnums=0, static_argnames=("share_prompts",))


@nnx.jit
def forward(model, tokens, where, record):
    """The router logits and the routing of the model's own forward pass, and the routing
    of the forward pass replaying `record` (layer-first `[M, B, T, k]`)."""
    _, logits, own = model(tokens, where=where, return_router_logits=True, return_routing=True)
    _, replayed = model(tokens, where=where, routing=record, return_routing=True)
    return logits, own, replayed


def split(config: DecoderConfig, seed: int = 0):
    return nnx.split(Decoder(config, rngs=nnx.Rngs(seed)))


def layer_first(routing):
    """A `Rollout.routing` `[R, T, M, k]` in the decoder's layout `[M, R, T, k]`."""
    return np.transpose(np.asarray(routing), (2, 0, 1, 3))


def sequences(prompts, out, group: int):
    """Each completion after its prompt, `[R, P + N]` tokens and mask, as the record's columns."""
    prompts = np.repeat(prompts, group, axis=0)
    where = np.repeat(PROMPT_WHERE, group, axis=0)
    return (
        np.concatenate([prompts, np.asarray(out.tokens)], axis=1),
        np.concatenate([where, np.asarray(out.where)], axis=1),
    )


@pytest.mark.parametrize(
    ("fields", "group"),
    [
        ({}, 2),
        ({"scan_layers": True}, 1),
        ({"num_hidden_layers": 3, "decoder_sparse_step": 2}, 2),  # dense, MoE, dense
    ],
    ids=["unrolled", "scanned", "mixed"],
)
def test_the_sampler_records_the_forward_pass_routing_and_replay_uses_it(fields, group):
    """float32: where no two experts are within 1e-4 of the top-k boundary, the record equals
    the full forward pass's own choice; replayed, the forward pass routes exactly by it and
    the trainer's log-probs equal the sampler's."""
    config = DecoderConfig(**{**CONFIG, **fields})
    graphdef, params = split(config)
    out = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(1), SAMPLING,
                 group_size=group, record_routing=True)  # fmt: skip
    moe = sum(config.moe_layers)
    rows, length = PROMPTS.shape[0] * group, PROMPTS.shape[1] + SAMPLING.max_new_tokens
    assert out.routing.shape == (rows, length, moe, 2) and out.routing.dtype == jnp.int32
    tokens, where = sequences(PROMPTS, out, group)
    record = layer_first(out.routing)
    logits, own, replayed = forward(nnx.merge(graphdef, params), tokens, where, record)
    ranked = -np.sort(-np.asarray(logits), axis=-1)
    clear = np.asarray(where)[None] & (ranked[..., 1] - ranked[..., 2] > 1e-4)
    assert clear.mean() > 0.8
    recorded, own = np.sort(record, -1), np.sort(np.asarray(own), -1)
    np.testing.assert_array_equal(recorded[clear], own[clear])
    np.testing.assert_array_equal(replayed, record)
    for share in (True, False) if group > 1 else (True,):  # one prompt a group: one path
        logps = score(graphdef, params, PROMPTS, PROMPT_WHERE, out.tokens, out.where,
                      routing=out.routing, share_prompts=share)  # fmt: skip
        assert_close(logps, out.logps, rtol=1e-5, atol=2e-5)


def moe_reference(x, router, gate, up, down, chosen, normalize):
    """The replayed layer token by token in float64: the chosen experts' SwiGLU outputs, each
    weighted by its softmax probability (renormalised over the chosen set when `normalize`)."""
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        probs = softmax64(row @ router)
        weights = probs[chosen[t]] / (probs[chosen[t]].sum() if normalize else 1.0)
        for e, weight in zip(chosen[t], weights, strict=True):
            g, u = row @ gate[e], row @ up[e]
            out[t] += weight * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


def router_gradient_reference(x, router, gate, up, down, chosen, normalize, cotangent):
    """d sum(cotangent * out) / d router in float64, through the gate weights alone (the
    experts' outputs do not depend on the router)."""
    grad_logits = np.zeros((x.shape[0], router.shape[1]))
    for t, row in enumerate(x):
        probs, k = softmax64(row @ router), chosen[t]
        outputs = []
        for e in k:
            g, u = row @ gate[e], row @ up[e]
            outputs.append((g / (1 + np.exp(-g)) * u) @ down[e])
        pull = np.array([cotangent[t] @ y for y in outputs])  # dL / dw_e
        if normalize:
            w = probs[k] / probs[k].sum()
            grad_logits[t, k] = w * (pull - pull @ w)
        else:
            grad_logits[t] = -probs * (pull @ probs[k])
            grad_logits[t, k] += probs[k] * pull
    return x.T @ grad_logits


@pytest.mark.parametrize("normalize", [False, True])
def test_replayed_gate_weights_and_their_router_gradient_equal_a_float64_reference(normalize):
    """Replayed experts that top-k would not choose (the bottom two): the output is their
    gated combination and the router's gradient flows through the gate weights."""
    with jax.enable_x64(True):
        config = DecoderConfig(**{**CONFIG, "norm_topk_prob": normalize}, dtype="float64",
                               param_dtype="float64")  # fmt: skip
        layer = MoE(config, rngs=nnx.Rngs(0))
        x = np.random.default_rng(3).normal(size=(2, 3, 16))
        logits = np.asarray(layer(jnp.asarray(x))[1]).reshape(-1, 4)
        chosen = np.argsort(logits, axis=-1, kind="stable")[:, :2].astype(np.int32)
        cotangent = np.random.default_rng(4).normal(size=(6, 16))
        graphdef, state = nnx.split(layer)

        def loss(router):
            pure = nnx.to_pure_dict(state)
            pure["gate"]["kernel"] = router
            out, _, used = nnx.merge(graphdef, pure)(
                jnp.asarray(x), jnp.asarray(chosen).reshape(2, 3, 2), return_routing=True
            )
            return jnp.sum(out.reshape(-1, 16) * cotangent), (out, used)

        e = layer.experts
        weights = [
            np.asarray(w[...])
            for w in (layer.gate.kernel, e["gate_proj"].kernel, e["up_proj"].kernel,
                      e["down_proj"].kernel)
        ]  # fmt: skip
        grad, (out, used) = jax.grad(loss, has_aux=True)(jnp.asarray(weights[0]))
    np.testing.assert_array_equal(np.asarray(used).reshape(-1, 2), chosen)
    flat = x.reshape(-1, 16)
    assert_close(out.reshape(-1, 16), moe_reference(flat, *weights, chosen, normalize),
                 rtol=1e-12, atol=1e-12)  # fmt: skip
    expected = router_gradient_reference(flat, *weights, chosen, normalize, cotangent)
    assert np.all(np.isfinite(grad)) and np.abs(expected).max() > 1e-3
    assert_close(grad, expected, rtol=1e-10, atol=1e-12)


def tied_models(scan: bool):
    """float32 params whose experts 2 and 3 have one router column (their logits tie
    exactly, so top-k picks expert 2), and a copy whose expert 3 scores higher by 1e-5 of
    that logit: far less than bfloat16's rounding of the two paths (4e-3), a near tie that
    the trainer breaks the other way wherever the logit is positive. With renormalised
    weights, those over a set without expert 3 are the same under both, and those over
    {2, 3} move by about 1e-5 of the logit / 4."""
    config = DecoderConfig(**{**CONFIG, "num_hidden_layers": 1}, scan_layers=scan)
    graphdef, params = split(config, seed=5)
    pure = nnx.to_pure_dict(params)
    layers = {0: pure["layers"] if scan else pure["layers"][0]}
    for layer in layers.values():
        kernel = np.array(layer["mlp"]["gate"]["kernel"])
        kernel[..., 3] = kernel[..., 2]
        layer["mlp"]["gate"]["kernel"] = jnp.asarray(kernel)
    sampler = jax.tree.map(jnp.asarray, pure)
    for layer in layers.values():
        kernel = np.array(layer["mlp"]["gate"]["kernel"])
        kernel[..., 3] *= 1 + 1e-5
        layer["mlp"]["gate"]["kernel"] = jnp.asarray(kernel)
    return graphdef, sampler, pure


@pytest.mark.parametrize("scan", [False, True])
def test_near_ties_that_flip_change_the_log_probs_and_replay_restores_them(scan):
    graphdef, sampler, trainer = tied_models(scan)
    prompts = np.random.default_rng(6).integers(3, 40, size=(4, 5))
    where = np.ones_like(prompts, bool)
    config = SamplingConfig(max_new_tokens=8, temperature=1.0)
    out = sample(graphdef, sampler, prompts, where, jax.random.key(2), config,
                 record_routing=True)  # fmt: skip
    tokens = np.concatenate([prompts, np.asarray(out.tokens)], axis=1)
    record = layer_first(out.routing)
    _, own, _ = forward(nnx.merge(graphdef, trainer), tokens, np.ones_like(tokens, bool), record)
    flipped = np.any(np.sort(np.asarray(own), -1) != np.sort(record, -1), -1)
    assert flipped.sum() >= 3  # tokens whose experts the trainer would choose otherwise

    plain = score(graphdef, trainer, prompts, where, out.tokens, out.where)
    replayed = score(graphdef, trainer, prompts, where, out.tokens, out.where,
                     routing=out.routing)  # fmt: skip
    # A flip at completion token j (column P + j) moves the log-probs from j + 1 on.
    first = np.argmax(flipped[0, :, 5:], axis=-1)
    moved = np.abs(np.asarray(plain - out.logps))
    after = np.arange(8)[None] > first[:, None]
    assert moved[after & flipped[0, :, 5:].any(-1)[:, None]].max() > 1e-3
    assert_close(replayed, out.logps, rtol=1e-5, atol=2e-5)

    def total(params):
        logps = completion_logps(graphdef, params, prompts, where, out.tokens, out.where,
                                 routing=out.routing)  # fmt: skip
        return jnp.sum(logps)

    grads = jax.jit(jax.grad(total))(trainer)
    layer = grads["layers"] if scan else grads["layers"][0]
    router = np.asarray(layer["mlp"]["gate"]["kernel"])
    assert np.all(np.isfinite(router)) and np.abs(router).max() > 1e-4


# Episodes of three turns, observations of 0 to 3 tokens between them (`Scripted`).
EPISODES = EpisodeConfig(sampling=SAMPLING, max_turns=3, max_tokens=24, max_observation_tokens=3)


def scripted(rows: int) -> list:
    sizes = [(2, 3), (1, 0), (3, 3), (3, 1)]
    return [Scripted(sizes[r % len(sizes)]) for r in range(rows)]


def episode_sequences(prompts, prompt_where, ep, group: int):
    """Each episode after its prompt, `[R, P + T]` tokens and mask (model and observation
    tokens), as the record's columns."""
    return (
        np.concatenate([np.repeat(prompts, group, 0), np.asarray(ep.tokens)], axis=1),
        np.concatenate([np.repeat(prompt_where, group, 0), np.asarray(ep.context_where)], axis=1),
    )


def test_episodes_record_the_routing_of_prompt_turns_and_observations():
    """float32: the episode's record covers its prompt, its model turns and the observations
    prefilled between them, in `completion_logps`'s layout; it equals the full forward pass's
    own choice where no two experts are within 1e-4 of the top-k boundary, the replayed pass
    routes exactly by it, and the trainer's log-probs equal the behaviour log-probs."""
    graphdef, params = split(DecoderConfig(**CONFIG))
    group = 2
    ep = run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(4), EPISODES,
                      scripted(4), group_size=group, record_routing=True)  # fmt: skip
    assert ep.routing.shape == (4, 5 + 24, 2, 2) and ep.routing.dtype == jnp.int32
    tokens, where = episode_sequences(PROMPTS, PROMPT_WHERE, ep, group)
    roles = np.concatenate([np.zeros((4, 5), np.int8), np.asarray(ep.roles)], axis=1)
    assert (roles == Role.OBSERVATION).sum() >= 8 and ep.num_turns.min() >= 2
    record = layer_first(ep.routing)
    logits, own, replayed = forward(nnx.merge(graphdef, params), tokens, where, record)
    ranked = -np.sort(-np.asarray(logits), axis=-1)
    clear = where[None] & (ranked[..., 1] - ranked[..., 2] > 1e-4)
    assert clear.mean() > 0.7 and clear[:, roles == Role.OBSERVATION].mean() > 0.7
    recorded, own = np.sort(record, -1), np.sort(np.asarray(own), -1)
    np.testing.assert_array_equal(recorded[clear], own[clear])
    np.testing.assert_array_equal(replayed, record)
    assert (record[:, :, 5:][:, ~np.asarray(ep.context_where)] == 0).all()  # padding
    model_tokens = np.asarray(ep.where)
    for share in (True, False):
        logps = score(graphdef, params, PROMPTS, PROMPT_WHERE, ep.tokens, ep.context_where,
                      routing=ep.routing, share_prompts=share)  # fmt: skip
        assert_close(np.where(model_tokens, logps, 0), ep.logps, rtol=1e-5, atol=2e-5)


def test_episodes_near_ties_that_flip_are_replayed():
    """The near tie of `tied_models` over multi-turn episodes: the trainer's own forward pass
    routes some tokens elsewhere than the episode's turns and observations did, which moves
    the log-probs of the model tokens after them; replaying `Episode.routing` brings them
    back to the behaviour log-probs."""
    graphdef, sampler, trainer = tied_models(scan=False)
    prompts = np.random.default_rng(8).integers(3, 40, size=(4, 5))
    where = np.ones_like(prompts, bool)
    sampling = SamplingConfig(max_new_tokens=5, temperature=1.0)
    config = dataclasses.replace(EPISODES, sampling=sampling)
    ep = run_episodes(graphdef, sampler, prompts, where, jax.random.key(9), config, scripted(4),
                      record_routing=True)  # fmt: skip
    tokens, real = episode_sequences(prompts, where, ep, 1)
    record = layer_first(ep.routing)
    _, own, _ = forward(nnx.merge(graphdef, trainer), tokens, real, record)
    flipped = np.any(np.sort(np.asarray(own), -1) != np.sort(record, -1), -1)[0] & real
    assert flipped.sum() >= 3
    model_tokens = np.asarray(ep.where)
    plain = score(graphdef, trainer, prompts, where, ep.tokens, ep.context_where)
    replayed = score(graphdef, trainer, prompts, where, ep.tokens, ep.context_where,
                     routing=ep.routing)  # fmt: skip
    assert np.abs(np.asarray(plain - ep.logps))[model_tokens].max() > 1e-3
    assert_close(np.where(model_tokens, replayed, 0), ep.logps, rtol=1e-5, atol=2e-5)


def test_gemma4_moe_records_and_replays():
    """Gemma 4's parallel experts (its router, per-expert scales): replayed, the trainer's
    log-probs equal the sampler's, and the forward pass routes by the record."""
    config = DecoderConfig(**GEMMA4_MOE)
    graphdef, params = split(config)
    prompts = PROMPTS % config.vocab_size
    out = sample(graphdef, params, prompts, PROMPT_WHERE, jax.random.key(3), SAMPLING,
                 group_size=2, record_routing=True)  # fmt: skip
    assert out.routing.shape == (4, 11, sum(config.moe_layers), 2)
    tokens, where = sequences(prompts, out, 2)
    record = layer_first(out.routing)
    _, _, used = forward(nnx.merge(graphdef, params), tokens, where, record)
    np.testing.assert_array_equal(used, record)
    logps = score(graphdef, params, prompts, PROMPT_WHERE, out.tokens, out.where,
                  routing=out.routing)  # fmt: skip
    assert_close(logps, out.logps, rtol=1e-5, atol=2e-5)


def test_replay_under_expert_parallel_sharding_equals_one_device():
    """In float64, as `tests/models/test_moe.py`'s: a replayed forward pass's loss and
    gradients with the experts over "expert" (4) and widths over "model" (2) equal one
    device's, the router's gradient nonzero."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 40, size=(4, 6))
    # Two distinct experts per token, whatever top-k would choose.
    routing = np.argsort(rng.random((2, 4, 6, 8)), axis=-1)[..., :2].astype(np.int32)
    with jax.enable_x64(True):
        config = DecoderConfig(**{**CONFIG, "num_experts": 8, "num_attention_heads": 4},
                               dtype="float64", param_dtype="float64")  # fmt: skip
        graphdef, params = split(config)

        def loss(params, routing):
            model = nnx.merge(graphdef, params)
            return jnp.mean(model.unembed(model(tokens, routing=routing)) ** 2)

        step = jax.jit(jax.value_and_grad(loss))
        single = step(params, routing)
        auto = (jax.sharding.AxisType.Auto,) * 3
        mesh = jax.make_mesh((1, 4, 2), ("data", "expert", "model"), axis_types=auto)
        shardings = param_shardings(graphdef, params, mesh, EXPERT_PARALLEL_RULES)
        sharded = step(jax.device_put(params, shardings), routing)
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
        assert_close(got, want, rtol=1e-10, atol=1e-12)
    router = np.asarray(single[1]["layers"][0]["mlp"]["gate"]["kernel"])
    assert np.all(np.isfinite(router)) and np.abs(router).max() > 1e-6


def test_bad_routing_is_refused_with_one_line_naming_it():
    config = DecoderConfig(**CONFIG)
    graphdef, params = split(config)
    model = nnx.merge(graphdef, params)
    tokens = np.ones((2, 3), np.int32)
    good = np.zeros((2, 2, 3, 2), np.int32)
    with own_checks():
        for bad, named in (
            (good[:, :, :2], "[M, B, T, k]"),  # wrong shape
            (good[:1], "M=2"),  # another layer count
            (good[..., :1], "num_experts_per_tok"),  # another k
            (good.astype(np.float32), "integer"),
        ):
            with raises_naming("routing", named):
                model(tokens, routing=bad)
        with raises_naming("routing", "[0, 4)"):
            model(tokens, routing=good + 4)  # recorded for a model with more experts
        with raises_naming("routing", "[2, 7, M, k]"):
            completion_logps(graphdef, params, PROMPTS, PROMPT_WHERE, tokens[:, :2] + 3,
                             np.ones((2, 4), bool)[:, :2], routing=good)  # fmt: skip
        dense_graphdef, dense = split(DecoderConfig(**{**CONFIG, "num_experts": 0}))
        with raises_naming("routing", "no mixture-of-experts"):
            nnx.merge(dense_graphdef, dense)(tokens, routing=good)
        with raises_naming("record_routing", "no mixture-of-experts"):
            sample(dense_graphdef, dense, PROMPTS, PROMPT_WHERE, jax.random.key(0), SAMPLING,
                   record_routing=True)  # fmt: skip
        with raises_naming("record_routing", "no mixture-of-experts"):
            run_episodes(dense_graphdef, dense, PROMPTS, PROMPT_WHERE, jax.random.key(0),
                         EPISODES, scripted(2), record_routing=True)  # fmt: skip
    # Traced, an out-of-range id cannot be seen: that token's hidden state is NaN.
    outside = good.copy()
    outside[1, 0, 2, 0] = 7  # the last layer, row 0, position 2
    hidden = np.asarray(nnx.jit(lambda m, r: m(tokens, routing=r))(model, outside))
    assert np.isnan(hidden[0, 2]).all()
    assert np.isfinite(hidden[0, :2]).all() and np.isfinite(hidden[1]).all()
