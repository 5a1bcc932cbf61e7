import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import assert_close, assert_within_float32_rounding, own_checks, raises_naming
from tests.models.test_per_layer import family_model
from tunelib.models import TENSOR_PARALLEL_RULES, Decoder, DecoderConfig, param_shardings
from tunelib.rollout import Rollout, SamplingConfig, completion_logps, process_logits, sample
from tunelib.rollout import _sampler as sampler_module

CONFIG = DecoderConfig(
    vocab_size=24,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=8,
    use_qk_norm=True,
)
# Left-padded, full, and right-padded prompts.
PROMPTS = np.array([[0, 0, 5, 9, 3], [7, 1, 4, 4, 8], [6, 11, 2, 0, 0]], np.int32)
PROMPT_WHERE = np.array(
    [[False, False, True, True, True], [True] * 5, [True, True, True, False, False]]
)


@functools.cache
def _initial_state(config: DecoderConfig):
    """The graph definition and a jitted initialisation (one compilation per config)."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    init = jax.jit(lambda key: nnx.to_pure_dict(nnx.state(Decoder(config, rngs=nnx.Rngs(key)))))
    return graphdef, init


def make_model(seed: int = 0, config: DecoderConfig = CONFIG):
    """A decoder with weights large enough that its next-token distributions are peaked."""
    graphdef, init = _initial_state(config)
    rng = np.random.default_rng(seed)
    pure = jax.tree.map(
        lambda x: jnp.asarray(
            x + (0.3 if x.ndim > 1 else 0.0) * rng.standard_normal(x.shape), x.dtype
        ),
        init(jax.random.key(seed)),
    )
    return graphdef, pure


def float64_twin(params, config: DecoderConfig = CONFIG):
    """`config`'s decoder in float64 with `params` (a float32 model's weights, exactly): its
    `(graphdef, params)`, to use under `jax.enable_x64`. Two computations claimed to be one
    function are compared on it, or against it: in float32 they sum in different orders and
    differ by a rounding whose size depends on the CPU."""
    config = dataclasses.replace(config, dtype="float64", param_dtype="float64")
    with jax.enable_x64(True):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
        return graphdef, jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)


@jax.jit(static_argnums=0)
def full_logits(graphdef, params, tokens, where):
    """Uncached `[B, T, V]` logits of whole sequences."""
    model = nnx.merge(graphdef, params)
    return model.unembed(model(tokens, where=where))


def naive_greedy(graphdef, params, prompts, where, steps, stop=()):
    """Greedy decoding that re-runs the full forward pass for every token (NumPy loop).

    The sequence lives in one buffer of its final length with the tokens still to come masked
    out (attention is causal, so a position never sees them): every step runs the same
    compiled forward, over the prompt and the tokens so far.
    """
    prompts, where = np.asarray(prompts), np.asarray(where)
    rows, p = prompts.shape
    tokens = np.concatenate([prompts, np.zeros((rows, steps), prompts.dtype)], axis=1)
    real = np.concatenate([where, np.zeros((rows, steps), bool)], axis=1)
    done = np.zeros(rows, bool)
    out, mask = [], []
    for i in range(steps):
        logits = np.asarray(full_logits(graphdef, params, tokens, real))
        next_token = logits[:, p + i - 1].argmax(-1)
        out.append(np.where(done, 0, next_token))
        mask.append(~done)
        done = done | np.isin(next_token, stop)
        tokens[:, p + i], real[:, p + i] = next_token, True
    return np.stack(out, 1), np.stack(mask, 1)


def completion_logits(graphdef, params, rollout, prompts=PROMPTS, where=PROMPT_WHERE, group=1):
    """The logits that predicted each completion token, from one uncached forward pass."""
    p = prompts.shape[1]
    tokens = np.concatenate([np.repeat(prompts, group, 0), np.asarray(rollout.tokens)], 1)
    real = np.concatenate([np.repeat(where, group, 0), np.asarray(rollout.where)], 1)
    logits = np.asarray(full_logits(graphdef, params, tokens, real), np.float64)
    # A right-padded prompt's last real token predicts the first completion token.
    last = p - 1 - np.argmax(np.repeat(where, group, 0)[:, ::-1], axis=1)
    first = logits[np.arange(len(tokens)), last][:, None]
    return np.concatenate([first, logits[:, p : p + rollout.tokens.shape[1] - 1]], axis=1)


def assert_no_near_ties(graphdef, params, rollout, prompts=PROMPTS, where=PROMPT_WHERE):
    """`rollout`'s greedy tokens are the formula's, not rounding's: at every real step the
    largest logit exceeds the runner-up by more than 1e-3. Two programs that compute the
    logits in different orders (cached or not, sharded or not, scanned or not) differ by
    about 1e-5 in float32 here; a closer pair could be chosen either way on another CPU."""
    logits = np.sort(completion_logits(graphdef, params, rollout, prompts, where), axis=-1)
    gap = (logits[..., -1] - logits[..., -2])[np.asarray(rollout.where)]
    assert gap.min() > 1e-3, gap.min()


# The greedy config of every test that needs one on `CONFIG`'s decoder and `PROMPTS`: one
# compilation of the sampler for all of them.
GREEDY = SamplingConfig(max_new_tokens=6, temperature=0.0)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_temperature_zero_is_exact_greedy():
    graphdef, params = make_model()
    out = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(0), GREEDY)
    # The naive loop appends after the last column, which is right only for the first two
    # rows (the third is right-padded); the third row is checked below.
    tokens, _ = naive_greedy(graphdef, params, PROMPTS, PROMPT_WHERE, GREEDY.max_new_tokens)
    np.testing.assert_array_equal(out.tokens[:2], tokens[:2])
    # The right-padded row, checked against the logits of one uncached pass.
    logits = completion_logits(graphdef, params, out)
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    assert_no_near_ties(graphdef, params, out)
    assert np.asarray(out.where).all() and np.asarray(out.truncated).all()
    # Finite log-probs: those of the untempered distribution, which the rollout records.
    expected = np.take_along_axis(log_softmax(logits), np.asarray(out.tokens)[..., None], -1)
    assert_close(out.logps, expected[..., 0], rtol=1e-4, atol=1e-4)
    assert np.isfinite(np.asarray(out.logps)).all()
    assert out.temperature.dtype == jnp.float32 and out.temperature.shape == ()
    assert out.temperature == 1.0


@pytest.mark.parametrize("logps_of", ["tempered", "processed"])
def test_a_temperature_that_overflows_the_logits_samples_the_argmax(logps_of):
    """At a temperature so small that the logits over it overflow float32 (here 1.2e-38, with
    logits up to about 5.5), sampling is greedy decoding: the argmax at every step (no tie
    of infinities, no NaN draw), with log-probs 0 for the token drawn (finite)."""
    graphdef, params = make_model()
    tiny = dataclasses.replace(GREEDY, temperature=1.2e-38, logps_of=logps_of)
    out = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(0), tiny)
    logits = completion_logits(graphdef, params, out)
    assert np.abs(logits).max() / 1.2e-38 > np.finfo(np.float32).max  # it would overflow
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    greedy = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(0), GREEDY)
    np.testing.assert_array_equal(out.tokens, greedy.tokens)
    np.testing.assert_array_equal(np.asarray(out.logps), 0.0)


def test_greedy_sampling_with_the_cache_runs_under_x64():
    """Under `jax.enable_x64`, where Python ints index as int64 beside the cache's int32
    index, a float64 decoder samples through its KV cache: the greedy tokens are the argmax of
    one uncached float64 pass and the log-probs its log-softmax (which the sampler takes in
    float32)."""
    _, params = make_model()
    model64 = float64_twin(params)
    with jax.enable_x64(True):
        out = sample(*model64, PROMPTS, PROMPT_WHERE, jax.random.key(0), GREEDY, group_size=2)
        logits = completion_logits(*model64, out, group=2)
        assert full_logits(*model64, PROMPTS, PROMPT_WHERE).dtype == jnp.float64
    top2 = np.sort(logits, axis=-1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 1e-3  # no near-ties for float32 to break
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    assert np.asarray(out.where).all() and out.tokens.dtype == jnp.int32
    expected = np.take_along_axis(log_softmax(logits), np.asarray(out.tokens)[..., None], -1)
    assert_close(out.logps, expected[..., 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("logps_of", ["tempered", "processed"])
def test_logps_are_those_of_the_stated_distribution(logps_of):
    graphdef, params = make_model(1)
    config = SamplingConfig(max_new_tokens=6, temperature=0.7, top_k=5, logps_of=logps_of)
    out = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(3), config, group_size=2)
    logits = completion_logits(graphdef, params, out, group=2)
    # The rollout's own temperature is all a trainer needs to recompute the log-probs.
    assert out.temperature.dtype == jnp.float32 and out.temperature == np.float32(0.7)
    tempered = logits / np.float64(out.temperature)
    if logps_of == "processed":
        flat = jnp.asarray(logits.reshape(-1, logits.shape[-1]), jnp.float32)
        processed = process_logits(flat, temperature=0.7, top_k=5)
        tempered = np.asarray(processed, np.float64).reshape(logits.shape)
    expected = np.take_along_axis(log_softmax(tempered), np.asarray(out.tokens)[..., None], -1)
    assert_close(out.logps, expected[..., 0], rtol=1e-4, atol=1e-4)
    # Every sampled token is among the 5 most likely of its step.
    rank = (logits > np.take_along_axis(logits, np.asarray(out.tokens)[..., None], -1)).sum(-1)
    assert (rank < 5).all()


def test_top_k_one_is_greedy_and_forbidden_tokens_are_never_drawn():
    graphdef, params = make_model(2)
    greedy = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(0), GREEDY)
    top1 = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(5),
                  SamplingConfig(max_new_tokens=6, temperature=1.3, top_k=1))  # fmt: skip
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)
    assert_no_near_ties(graphdef, params, greedy)
    banned = tuple(int(t) for t in np.unique(greedy.tokens))
    config = SamplingConfig(max_new_tokens=6, temperature=0.0, forbidden_tokens=banned)
    out = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(0), config)
    assert not np.isin(np.asarray(out.tokens), banned).any()
    hot = SamplingConfig(max_new_tokens=6, temperature=2.0, forbidden_tokens=banned)
    for seed in range(3):
        out = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(seed), hot)
        assert not np.isin(np.asarray(out.tokens), banned).any()


def test_stop_tokens_end_the_completion_inside_the_mask():
    graphdef, params = make_model(3)
    config = SamplingConfig(max_new_tokens=10, temperature=1.5, pad_token=23)
    free = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(1), config)
    # Stop on two tokens that the unconstrained draw produces mid-completion.
    stops = tuple(int(t) for t in np.asarray(free.tokens)[:, 2][:2])
    stopped = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(1),
                     dataclasses.replace(config, stop_tokens=stops))  # fmt: skip
    tokens, where = np.asarray(stopped.tokens), np.asarray(stopped.where)
    for row in range(len(tokens)):
        hits = np.flatnonzero(np.isin(free.tokens[row], stops))
        end = hits[0] + 1 if hits.size else 10
        # Same key, same draws up to the stop token; EOS inside, nothing after it.
        np.testing.assert_array_equal(tokens[row, :end], np.asarray(free.tokens)[row, :end])
        assert where[row, :end].all() and not where[row, end:].any()
        assert (tokens[row, end:] == 23).all() and (np.asarray(stopped.logps)[row, end:] == 0).all()
        assert stopped.lengths[row] == end
        assert bool(stopped.truncated[row]) == (hits.size == 0)
    assert not np.asarray(stopped.truncated)[:2].any()


def test_keys_reproduce_and_differ():
    graphdef, params = make_model(4)
    config = SamplingConfig(max_new_tokens=12, temperature=1.0)
    a = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(7), config)
    b = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(7), config)
    c = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(8), config)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()
    # Legacy uint32 keys work the same way.
    legacy = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.PRNGKey(7), config)
    np.testing.assert_array_equal(legacy.tokens, a.tokens)
    # Steps draw with different keys: a row's tokens are not one draw repeated.
    assert len(set(np.asarray(a.tokens)[0].tolist())) > 1


def test_grouped_sampling_equals_repeated_prompts():
    graphdef, params = make_model(5)
    config = SamplingConfig(max_new_tokens=6, temperature=1.0, stop_tokens=(3,))
    grouped = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(2), config,
                     group_size=4)  # fmt: skip
    repeated = sample(graphdef, params, np.repeat(PROMPTS, 4, 0), np.repeat(PROMPT_WHERE, 4, 0),
                      jax.random.key(2), config)  # fmt: skip
    for field in ("tokens", "where", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(grouped, field), getattr(repeated, field))
    # G rows decoding after one shared prompt and repeated prompts sum in different orders,
    # so they agree to float32 rounding: the grouped log-probs are held within 4x the repeated
    # ones' distance from float64 on the same weights (the sampler does not run in float64;
    # `completion_logps` computes the log-probs it would).
    prompts = np.repeat(PROMPTS, 4, 0), np.repeat(PROMPT_WHERE, 4, 0)
    with jax.enable_x64(True):
        score = jax.jit(completion_logps, static_argnums=0)
        exact = score(*float64_twin(params), *prompts, repeated.tokens, repeated.where)
    assert exact.dtype == jnp.float64
    assert_within_float32_rounding(grouped.logps, repeated.logps, exact)
    tokens = np.asarray(grouped.tokens).reshape(3, 4, -1)
    assert any(len({tuple(r) for r in tokens[b]}) > 1 for b in range(3))  # the G rows differ


def test_early_stop_and_no_recompilation():
    graphdef, params = make_model(6)
    config = SamplingConfig(max_new_tokens=40, temperature=1.0, stop_tokens=tuple(range(24)))
    out = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(0), config)
    # Every token stops, so every completion is its first token.
    np.testing.assert_array_equal(out.lengths, [1, 1, 1])
    compiled = sampler_module._sample._cache_size()  # this program, whichever test made it
    other = jax.tree.map(lambda x: x + 0.01, params)
    sample(graphdef, other, PROMPTS[::-1], PROMPT_WHERE[::-1], jax.random.key(1), config)
    assert sampler_module._sample._cache_size() == compiled


def test_bad_input_is_rejected_before_compiling():
    graphdef, params = make_model()
    key = jax.random.key(0)
    ok = SamplingConfig(max_new_tokens=4)
    before = sampler_module._sample._cache_size()
    # What depends on the prompts or the vocabulary; the rest fails when the config is made.
    cases = [
        (dict(config=dataclasses.replace(ok, cache_length=8)), ("cache_length", "9")),
        (dict(config=dataclasses.replace(ok, stop_tokens=(24,))), ("stop_tokens", "24")),
        (dict(config=dataclasses.replace(ok, pad_token=30)), ("pad_token",)),
        (dict(config=dataclasses.replace(ok, forbidden_tokens=tuple(range(24)))), ("forbid",)),
        (dict(group_size=0), ("group_size",)),
        (dict(where=PROMPT_WHERE & np.array([[1], [0], [1]], bool)), ("prompt_where", "[1]")),
        (dict(prompts=PROMPTS.astype(np.float32)), ("prompt_tokens",)),
        (dict(prompts=np.where(PROMPTS == 9, 24, PROMPTS)), ("prompt_tokens", "24")),
        (dict(where=PROMPT_WHERE[:, :4]), ("prompt_where",)),
    ]
    for case, names in cases:
        args = {"prompts": PROMPTS, "where": PROMPT_WHERE, "config": ok, "group_size": 1, **case}
        with raises_naming(*names):
            sample(graphdef, params, args["prompts"], args["where"], key, args["config"],
                   group_size=args["group_size"])  # fmt: skip
    assert sampler_module._sample._cache_size() == before


@pytest.mark.parametrize(
    ("changes", "error", "names"),
    [
        (dict(max_new_tokens=0), ValueError, ("max_new_tokens", ">= 1", "got 0")),
        (dict(max_new_tokens=2.0), TypeError, ("max_new_tokens", "int", "2.0")),
        (dict(temperature=-1), ValueError, ("temperature", ">= 0", "greedy", "got -1")),
        (dict(temperature=float("inf")), ValueError, ("temperature", "finite", "inf")),
        (dict(temperature=float("nan")), ValueError, ("temperature", "got nan")),
        (dict(temperature="1.0"), TypeError, ("temperature", "real number")),
        (dict(temperature=1e-40), ValueError, ("temperature", "smallest normal", "1e-40")),
        (dict(top_k=0), ValueError, ("top_k", ">= 1", "got 0")),
        (dict(top_k=2.5), TypeError, ("top_k", "int", "2.5")),
        (dict(top_p=0), ValueError, ("top_p", "(0, 1]", "got 0")),
        (dict(top_p=1.5), ValueError, ("top_p", "(0, 1]", "got 1.5")),
        (dict(top_p="0.9"), TypeError, ("top_p", "real number")),
        (dict(min_p=-0.1), ValueError, ("min_p", "[0, 1]", "got -0.1")),
        (dict(min_p=2), ValueError, ("min_p", "[0, 1]", "got 2")),
        (dict(forbidden_tokens=(1, -2)), ValueError, ("forbidden_tokens", "-2")),
        (dict(forbidden_tokens=3), TypeError, ("forbidden_tokens", "tuple")),
        (dict(stop_tokens=(-1,)), ValueError, ("stop_tokens", "-1")),
        (dict(stop_tokens=("eos",)), TypeError, ("stop_tokens", "'eos'")),
        (dict(pad_token=-1), ValueError, ("pad_token", ">= 0", "got -1")),
        (dict(pad_token=None), TypeError, ("pad_token", "int")),
        (dict(cache_length=4), ValueError, ("cache_length", ">= 5", "got 4", "max_new_tokens=4")),
        (dict(cache_length=8.0), TypeError, ("cache_length", "int")),
        (dict(logps_of="raw"), ValueError, ("logps_of", "'tempered'", "'raw'")),
    ],
)
def test_sampling_config_checks_each_field_when_made(changes, error, names):
    with own_checks(), raises_naming(*names, error=error):
        SamplingConfig(**{"max_new_tokens": 4, **changes})


def test_sampling_config_stores_plain_python_values():
    with own_checks():  # NumPy numbers and lists, which the annotations do not advertise
        config = SamplingConfig(
            max_new_tokens=np.int64(4), temperature=np.float32(0.5), top_k=np.int32(3),
            top_p=1, min_p=0, forbidden_tokens=[np.int64(1), 2], stop_tokens=[5],
            cache_length=5,
        )  # fmt: skip
    assert config == SamplingConfig(
        max_new_tokens=4, temperature=0.5, top_k=3, top_p=1.0, min_p=0.0,
        forbidden_tokens=(1, 2), stop_tokens=(5,), cache_length=5,
    )  # fmt: skip
    assert type(config.max_new_tokens) is int and type(config.temperature) is float
    assert type(config.forbidden_tokens[0]) is int and hash(config) is not None
    greedy = SamplingConfig(max_new_tokens=1, temperature=0)  # 0 is greedy, not an error
    assert greedy.temperature == 0.0


def test_rollout_is_a_pytree_of_arrays_with_its_temperature():
    rollout = Rollout(
        tokens=jnp.zeros((2, 3), jnp.int32), where=jnp.ones((2, 3), bool),
        logps=jnp.zeros((2, 3)), lengths=jnp.full(2, 3), truncated=jnp.zeros(2, bool),
        temperature=jnp.float32(0.7),
    )  # fmt: skip
    # Six arrays; routing (unless recorded), the policy stamp (unless `sample` was given
    # a policy_version) and the tokens' versions (`continue_rollout`'s) are None and have no
    # leaf.
    assert len(jax.tree.leaves(rollout)) == len(Rollout._fields) - 4 == 6
    assert rollout.routing is None and Rollout._fields.index("routing") == 6
    assert rollout.policy_version is None and rollout.fingerprint is None
    assert rollout.token_versions is None
    out = jax.jit(lambda r: r._replace(logps=r.logps - 1 / r.temperature))(rollout)
    assert isinstance(out, Rollout) and out.temperature == np.float32(0.7)
    assert_close(out.logps, np.full((2, 3), -1 / np.float32(0.7)))


def test_sampler_inside_a_users_jit():
    graphdef, params = make_model()

    @jax.jit
    def run(params, prompts, where):
        return sample(graphdef, params, prompts, where, jax.random.key(0), GREEDY)

    eager = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(0), GREEDY)
    jitted = run(params, PROMPTS, PROMPT_WHERE)
    np.testing.assert_array_equal(jitted.tokens, eager.tokens)
    assert isinstance(jitted, Rollout) and jitted.temperature == eager.temperature == 1.0


def test_sharded_greedy_equals_single_device():
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    config = dataclasses.replace(CONFIG, scan_layers=True, tie_word_embeddings=False)
    graphdef, params = make_model(7, config)
    prompts, where = np.tile(PROMPTS, (2, 1))[:4], np.tile(PROMPT_WHERE, (2, 1))[:4]
    sampling = SamplingConfig(max_new_tokens=10, temperature=0.0)
    expected = sample(graphdef, params, prompts, where, jax.random.key(0), sampling)

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharded = jax.device_put(params, param_shardings(graphdef, params, mesh))
    kernel = sharded["layers"]["mlp"]["up_proj"]["kernel"]
    assert kernel.sharding.spec == jax.P(None, None, "model") and len(kernel.devices()) == 8
    rows = jax.sharding.NamedSharding(mesh, jax.P("data"))
    out = sample(graphdef, sharded, jax.device_put(prompts, rows), jax.device_put(where, rows),
                 jax.random.key(0), sampling)  # fmt: skip
    np.testing.assert_array_equal(out.tokens, expected.tokens)
    assert_no_near_ties(graphdef, params, expected, prompts, where)
    assert_close(out.logps, expected.logps, rtol=1e-4, atol=1e-4)
    assert dict(TENSOR_PARALLEL_RULES)["q_heads"] == "model"


def test_state_params_and_scanned_layers_give_the_same_completions():
    config = dataclasses.replace(CONFIG, scan_layers=True)
    graphdef, pure = make_model(8, config)
    state = nnx.state(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, pure)  # every value replaced: made abstractly
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.9)
    a = sample(graphdef, pure, PROMPTS, PROMPT_WHERE, jax.random.key(1), sampling)
    b = sample(graphdef, state, PROMPTS, PROMPT_WHERE, jax.random.key(1), sampling)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    loop = make_model(8)  # the same weights unstacked: the loop over layers
    stacked = sample(graphdef, pure, PROMPTS, PROMPT_WHERE, jax.random.key(0), GREEDY)
    layers = jax.tree.map(np.asarray, pure["layers"])
    unstacked_pure = {**pure, "layers": {i: jax.tree.map(lambda x, i=i: x[i], layers)
                                         for i in range(config.num_hidden_layers)}}  # fmt: skip
    unstacked = sample(loop[0], unstacked_pure, PROMPTS, PROMPT_WHERE, jax.random.key(0), GREEDY)
    np.testing.assert_array_equal(stacked.tokens, unstacked.tokens)
    assert_no_near_ties(graphdef, pure, stacked)


# Two families here (sliding windows, soft-capping and layers of two kinds; experts): every
# family's layers are checked bit for bit in tests/models/test_per_layer.py.
@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe"])
def test_decoding_per_layer_equals_the_scan_over_the_stacks(family):
    """`sample(..., layout="per_layer")` runs `Decoder.decoding_layout`'s parameters: greedy
    and sampled tokens, stop tokens and behaviour log-probs equal, bit for bit, those of the
    scan over the stacks."""
    graphdef, params = nnx.split(family_model(family))
    prompts = np.array([[0, 3, 4, 9, 11], [5, 6, 7, 8, 1]])
    where = np.array([[False, True, True, True, True], [True] * 5])
    configs = [SamplingConfig(max_new_tokens=10, temperature=t, stop_tokens=(7,), pad_token=0)
               for t in (0.0, 0.9)]  # fmt: skip

    def rollouts(layout):
        return [sample(graphdef, params, prompts, where, jax.random.key(3), c, group_size=2,
                       layout=layout) for c in configs]  # fmt: skip

    for a, b in zip(rollouts("per_layer"), rollouts("stacked"), strict=True):
        for name in ("tokens", "where", "logps", "lengths", "truncated"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


# Wide enough that `Dense` blocks its float32 products on CPU (over 192 inputs: 2 blocks).
WIDE = dataclasses.replace(
    CONFIG, hidden_size=384, intermediate_size=768, head_dim=96, scan_layers=True
)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="blocks only on CPU")
@pytest.mark.parametrize("layout", ["stacked", "per_layer"])
def test_plain_products_round_otherwise_and_compile_apart(layout):
    """`products="plain"` (one dot a product) draws the tokens the blocked products draw (no
    near ties here) with behaviour log-probs within float32 rounding of theirs, but not
    equal: its program is traced and compiled apart from the blocked one, so the blocked
    call after it gives the first call's result bit for bit."""
    graphdef, params = make_model(config=WIDE)
    config = SamplingConfig(max_new_tokens=6, temperature=0.9)

    def run(products):
        return sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(1), config,
                      layout=layout, products=products)  # fmt: skip

    blocked, plain, again = run("blocked"), run("plain"), run("blocked")
    np.testing.assert_array_equal(plain.tokens, blocked.tokens)
    np.testing.assert_allclose(plain.logps, blocked.logps, rtol=0, atol=1e-4)
    assert not np.array_equal(plain.logps, blocked.logps)
    for name in ("tokens", "logps"):
        np.testing.assert_array_equal(getattr(again, name), getattr(blocked, name))


@pytest.mark.parametrize("keyword", ["layout", "products"])
def test_a_layout_or_products_not_known_is_refused(keyword):
    graphdef, params = make_model()
    config = SamplingConfig(max_new_tokens=2)
    with own_checks(), pytest.raises(ValueError, match=rf"{keyword} must be one of"):
        sample(graphdef, params, jnp.ones((1, 3), jnp.int32), jnp.ones((1, 3), bool),
               jax.random.key(0), config, **{keyword: "unrolled"})  # fmt: skip


def test_sample_keeps_no_reference_to_the_weights_it_was_given():
    """A training loop samples with new weights every step: once `sample` returns, nothing may
    hold the old ones (a module merged from them sits in reference cycles until Python's
    next garbage collection, which large arrays alone never trigger)."""
    import gc

    graphdef, params = make_model()
    prompts, where = jnp.ones((2, 4), jnp.int32), jnp.ones((2, 4), bool)
    config = SamplingConfig(max_new_tokens=2, temperature=0.0)
    gc.disable()
    try:
        for step in range(3):
            weights = jax.tree.map(lambda x, step=step: x + step, params)
            ids = {id(x) for x in jax.tree.leaves(weights)}
            sample(graphdef, weights, prompts, where, jax.random.key(0), config)
            del weights
            assert not ids & {id(x) for x in jax.live_arrays()}
    finally:
        gc.enable()
