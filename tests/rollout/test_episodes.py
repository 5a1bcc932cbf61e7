"""Multi-turn episodes: `run_episodes` against one forward pass over each episode, its layout
and limits, the loss masks, and the group-relative advantages of episodes and turns."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import (
    assert_close,
    assert_traced_once,
    assert_within_float32_rounding,
    own_checks,
    raises_naming,
)
from tests.rollout._chat import chat_tokenizer
from tests.rollout.test_sampler import (
    CONFIG as MODEL_CONFIG,
)
from tests.rollout.test_sampler import (
    PROMPT_WHERE,
    PROMPTS,
    WIDE,
    float64_twin,
    full_logits,
    log_softmax,
    make_model,
)
from tunelib.data import render_chat_template
from tunelib.losses import aggregate, policy_gradient_loss
from tunelib.models import DecoderConfig
from tunelib.rollout import (
    CALCULATOR,
    Episode,
    EpisodeConfig,
    Role,
    SamplingConfig,
    Step,
    ToolEnvironment,
    completion_logps,
    episode_advantages,
    run_episodes,
    turn_advantages,
)
from tunelib.rollout import _episodes as episodes_module

SAMPLING = SamplingConfig(max_new_tokens=5, temperature=0.8, top_k=12, stop_tokens=(3,))
CONFIG = EpisodeConfig(sampling=SAMPLING, max_turns=3, max_tokens=24, max_observation_tokens=3)
GROUP = 2


class Scripted:
    """An environment that answers each turn with up to `sizes[k]` of its tokens, reversed,
    rewards a turn with its length / 10, and is done after `len(sizes) + 1` turns; it records
    what it saw and said."""

    def __init__(self, sizes=(2, 0)):
        self.sizes = sizes

    def reset(self, prompt):
        self.prompt, self.turns, self.observations = prompt, [], []

    def step(self, turn):
        self.turns.append(turn)
        k = len(self.turns) - 1
        done = k == len(self.sizes)
        observation = () if done else turn.tokens[::-1][: self.sizes[k]]
        self.observations.append(observation)
        return Step(observation, len(turn.tokens) / 10, done)


def environments(rows=None):
    rows = len(PROMPTS) * GROUP if rows is None else rows
    sizes = [(2, 0), (1, 3), (3, 3), (0, 0), (2, 1), (3,)]
    return [Scripted(sizes[r % len(sizes)]) for r in range(rows)]


@pytest.fixture(scope="module")
def model():
    return make_model(seed=11)


@pytest.fixture(scope="module")
def episode(model):
    envs = environments()
    graphdef, params = model
    out = run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(3), CONFIG, envs,
                       group_size=GROUP)  # fmt: skip
    return out, envs


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="blocks only on CPU")
def test_plain_products_reach_the_prefill_turns_and_observations():
    """`products="plain"` reaches every program of an episode: the same tokens as the blocked
    products (no near ties on this model) with behaviour log-probs within float32 rounding of
    theirs, not equal to them."""
    graphdef, params = make_model(seed=11, config=WIDE)

    def run(products):
        return run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(3), CONFIG,
                            environments(), group_size=GROUP, products=products)  # fmt: skip

    blocked, plain = run("blocked"), run("plain")
    np.testing.assert_array_equal(plain.tokens, blocked.tokens)
    assert (np.asarray(plain.roles) == Role.OBSERVATION).any()  # observations were written
    np.testing.assert_allclose(plain.logps, blocked.logps, rtol=0, atol=1e-4)
    assert not np.array_equal(plain.logps, blocked.logps)


def check_layout(ep: Episode, config: EpisodeConfig = CONFIG) -> None:
    """The invariants of every episode: one contiguous run of turns and observations, then
    padding; turn boundaries, ids, masks and rewards that agree."""
    roles, turn_ids = np.asarray(ep.roles), np.asarray(ep.turn_ids)
    for r in range(roles.shape[0]):
        n = int(ep.lengths[r])
        assert (roles[r, :n] != Role.PADDING).all() and (roles[r, n:] == Role.PADDING).all()
        assert (np.asarray(ep.tokens)[r, n:] == config.sampling.pad_token).all()
        assert (turn_ids[r, n:] == -1).all() and (np.diff(turn_ids[r, :n]) >= 0).all()
        k = int(ep.num_turns[r])
        assert 1 <= k <= config.max_turns or bool(ep.failed[r])
        for j in range(k):
            start, end = int(ep.turn_starts[r, j]), int(ep.turn_ends[r, j])
            nxt = int(ep.turn_starts[r, j + 1]) if j + 1 < k else n
            assert start < end <= nxt
            assert (roles[r, start:end] == Role.MODEL).all() and (turn_ids[r, start:end] == j).all()
            assert (roles[r, end:nxt] == Role.OBSERVATION).all()
            assert (turn_ids[r, end:nxt] == j).all()
        assert (np.asarray(ep.turn_rewards)[r, k:] == 0).all()
    np.testing.assert_array_equal(ep.where, roles == Role.MODEL)
    np.testing.assert_array_equal(ep.context_where, roles != Role.PADDING)
    assert (np.asarray(ep.logps)[~np.asarray(ep.where)] == 0).all()
    assert (np.asarray(ep.logps)[np.asarray(ep.where)] <= 0).all()
    assert_close(ep.rewards, np.asarray(ep.turn_rewards, np.float64).sum(-1))
    assert not (np.asarray(ep.truncated) & np.asarray(ep.failed)).any()
    assert ep.tokens.dtype == jnp.int32 and ep.logps.dtype == jnp.float32
    assert ep.tokens.shape == (roles.shape[0], config.max_tokens)
    assert ep.turn_rewards.shape == (roles.shape[0], config.max_turns)


def test_the_episode_holds_exactly_what_was_sampled_and_observed(episode):
    ep, envs = episode
    check_layout(ep)
    tokens = np.asarray(ep.tokens)
    for r, env in enumerate(envs):
        # The environment got the row's real prompt, then each turn's ids as they were drawn.
        b = r // GROUP
        assert env.prompt == tuple(PROMPTS[b][PROMPT_WHERE[b]].tolist())
        assert len(env.turns) == int(ep.num_turns[r])
        for j, turn in enumerate(env.turns):
            start, end = int(ep.turn_starts[r, j]), int(ep.turn_ends[r, j])
            assert turn.tokens == tuple(tokens[r, start:end].tolist()) and turn.text is None
            assert turn.truncated == (turn.tokens[-1] != 3)  # no stop token: cut at 5
            assert len(turn.tokens) == 5 or not turn.truncated
            after = int(ep.turn_starts[r, j + 1]) if j + 1 < len(env.turns) else int(ep.lengths[r])
            assert tuple(tokens[r, end:after].tolist()) == tuple(env.observations[j])
        assert_close(ep.turn_rewards[r, : len(env.turns)], [len(t.tokens) / 10 for t in env.turns])
    # Every environment finished: the Scripted ones stop before max_turns and the budget.
    assert not np.asarray(ep.truncated).any() and not np.asarray(ep.failed).any()
    np.testing.assert_array_equal(ep.num_turns, [len(e.sizes) + 1 for e in envs])
    assert ep.temperature == np.float32(0.8)


def test_behaviour_logps_equal_one_forward_pass_over_the_episode(episode, model):
    """The episode's log-probs, decoded turn by turn through the cache, are those of the
    trainer's one pass over the episode. The two sum in different orders, so in float32 they
    agree to a rounding whose size depends on the CPU: they are held within 4x the one pass's
    distance from float64 on the same weights (episodes do not run in float64: under x64 the
    cache's index and slice starts mix int32 and int64)."""
    ep, _ = episode
    graphdef, params = model
    # The trainer's path: the whole episode scored at once, observations as context.
    score = jax.jit(completion_logps, static_argnums=0)
    logps = score(graphdef, params, PROMPTS, PROMPT_WHERE, ep.tokens, ep.context_where,
                  temperature=ep.temperature)  # fmt: skip
    where = np.asarray(ep.where)
    with jax.enable_x64(True):
        repeated = np.repeat(PROMPTS, GROUP, 0), np.repeat(PROMPT_WHERE, GROUP, 0)
        exact = score(*float64_twin(params), *repeated, ep.tokens, ep.context_where,
                      temperature=np.float64(ep.temperature))  # fmt: skip
    assert exact.dtype == jnp.float64
    assert_within_float32_rounding(ep.logps, np.where(where, logps, 0), np.where(where, exact, 0))
    # And from the full logits in float64, found by a loop over the real columns.
    both = np.concatenate([np.repeat(PROMPTS, GROUP, 0), np.asarray(ep.tokens)], 1)
    real = np.concatenate([np.repeat(PROMPT_WHERE, GROUP, 0), np.asarray(ep.context_where)], 1)
    logits = np.asarray(full_logits(graphdef, params, both, real), np.float64) / 0.8
    p = PROMPTS.shape[1]
    for r in range(len(both)):
        columns = np.flatnonzero(real[r])
        for t in np.flatnonzero(where[r]):
            before = columns[columns < p + t][-1]
            expected = log_softmax(logits[r, before])[both[r, p + t]]
            assert abs(float(ep.logps[r, t]) - expected) < 1e-4


def compacted_logits(graphdef, params, prompt, prompt_where, history):
    """Next-token logits after the prompt and `history` (ids), from one uncached pass."""
    tokens = np.concatenate([prompt, history])[None].astype(np.int32)
    where = np.concatenate([prompt_where, np.ones(len(history), bool)])[None]
    last = np.flatnonzero(where[0])[-1]  # a right-padded prompt's last real token
    return np.asarray(full_logits(graphdef, params, tokens, where))[0, last]


def test_cache_continuation_equals_prefilling_the_whole_history(model):
    """Turns and observations of different lengths per row, continued in one cache, give the
    logits of one pass over each row's history, with no padding in it."""
    graphdef, params = model
    model64 = float64_twin(params)
    rows = len(PROMPTS) * GROUP  # the shapes of the episodes above: nothing new to compile
    slots = PROMPTS.shape[1] + 3 * 5 + 2 * 3
    logits, cache = episodes_module._start(
        graphdef, params, PROMPTS, PROMPT_WHERE, slots, GROUP, False
    )
    history = [[] for _ in range(rows)]

    def check():
        """Each row's cached logits equal its unpadded pass's, to float32 rounding: within 4x
        that pass's distance from float64 (one right-padded float64 pass over every row)."""
        expected = [
            compacted_logits(graphdef, params, PROMPTS[r // GROUP], PROMPT_WHERE[r // GROUP], h)
            for r, h in enumerate(history)
        ]
        tokens = np.zeros((rows, slots), np.int32)
        where = np.zeros((rows, slots), bool)
        for r, h in enumerate(history):
            n = PROMPTS.shape[1] + len(h)
            tokens[r, :n] = np.concatenate([PROMPTS[r // GROUP], h])
            where[r, :n] = np.concatenate([PROMPT_WHERE[r // GROUP], np.ones(len(h), bool)])
        last = slots - 1 - np.argmax(where[:, ::-1], axis=1)
        with jax.enable_x64(True):
            exact = np.asarray(full_logits(*model64, tokens, where))[np.arange(rows), last]
        assert exact.dtype == np.float64
        assert_within_float32_rounding(list(np.asarray(logits)), expected, list(exact))

    check()
    observations = [[5, 6, 7], [], [9], [1, 1], [], [4, 2, 0]]
    limits = ([1, 5, 3, 2, 5, 4], [4, 2, 5, 5, 1, 3])
    for turn, limit in enumerate(limits):
        done = np.arange(rows) == 4 if turn else np.zeros(rows, bool)  # row 4 sits one out
        out = episodes_module._turn(graphdef, params, logits, cache, jax.random.key(turn),
                                    SAMPLING, (), done, np.array(limit, np.int32),
                                    False)  # fmt: skip
        logits, cache = out.logits, out.cache
        tokens, where = np.asarray(out.tokens), np.asarray(out.where)
        assert not where[done].any() and (where.sum(1)[~done] <= np.array(limit)[~done]).all()
        for r in range(rows):
            history[r] += tokens[r][where[r]].tolist()
        check()
        block = np.zeros((rows, 3), np.int32)
        block_where = np.zeros((rows, 3), bool)
        for r, ids in enumerate(observations):
            block[r, : len(ids)], block_where[r, : len(ids)] = ids, True
            history[r] += ids
        logits, cache = episodes_module._observe(graphdef, params, logits, cache, block,
                                                 block_where, False)  # fmt: skip
        check()
    real = PROMPT_WHERE.sum(1).repeat(GROUP) + np.array([len(h) for h in history])
    np.testing.assert_array_equal(cache.lengths, real)
    assert int(cache.index) > real.max()  # rows waited in padding slots


def test_a_multi_token_turn_end_sequence_ends_the_turn(model):
    graphdef, params = model
    greedy = SamplingConfig(max_new_tokens=5, temperature=0.0)
    config = EpisodeConfig(sampling=greedy, max_turns=1, max_tokens=5, max_observation_tokens=1)
    free = run_episodes(*model, PROMPTS, PROMPT_WHERE, jax.random.key(0), config,
                        [Scripted(()) for _ in PROMPTS])  # fmt: skip
    tokens = np.asarray(free.tokens)
    pair = tuple(tokens[0, 1:3].tolist())  # a pair the first row draws
    tagged = dataclasses.replace(config, turn_end_sequences=(pair, (23, 22, 21)))
    envs = [Scripted(()) for _ in PROMPTS]
    out = run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(0), tagged, envs)
    for r in range(len(PROMPTS)):
        row = tokens[r].tolist()
        hits = [i + 2 for i in range(len(row) - 1) if tuple(row[i : i + 2]) == pair]
        end = hits[0] if hits else 5
        assert int(out.lengths[r]) == end and np.asarray(out.tokens)[r, :end].tolist() == row[:end]
        assert envs[r].turns[0].truncated == (not hits)
    assert int(out.lengths[0]) == 3 and not envs[0].turns[0].truncated


class Forever:
    """Never done: observations of 1 token, then of 4 (more than `max_observation_tokens`)."""

    def reset(self, prompt):
        self.turns = []

    def step(self, turn):
        self.turns.append(turn)
        return Step(turn.tokens[:1] if len(self.turns) == 1 else (1, 2, 1, 2), 0.5, False)


def test_limits_end_episodes_as_truncated(model):
    graphdef, params = model
    rows, key = len(PROMPTS), jax.random.key(1)
    # The 4-token observation is longer than max_observation_tokens = 3: the episode ends
    # after its second turn, both scored.
    out = run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, key, CONFIG,
                       [Forever() for _ in range(rows)])  # fmt: skip
    check_layout(out)
    np.testing.assert_array_equal(out.num_turns, [2] * rows)
    assert np.asarray(out.truncated).all()
    assert_close(out.rewards, [1.0] * rows)
    # The turn limit.
    one = dataclasses.replace(CONFIG, max_turns=1)
    out = run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, key, one,
                       [Forever() for _ in range(rows)])  # fmt: skip
    np.testing.assert_array_equal(out.num_turns, [1] * rows)
    assert np.asarray(out.truncated).all() and (np.asarray(out.roles) != Role.OBSERVATION).all()
    # The token budget: 7 tokens hold a first turn, its 1-token observation and what is left.
    small = dataclasses.replace(CONFIG, max_tokens=7)
    envs = [Forever() for _ in range(rows)]
    out = run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, key, small, envs)
    check_layout(out, small)
    assert np.asarray(out.truncated).all() and (np.asarray(out.lengths) <= 7).all()
    for r, env in enumerate(envs):
        assert len(env.turns) == 2 and int(out.turn_starts[r, 1]) == len(env.turns[0].tokens) + 1
        # The second turn stops at its stop token or at the budget.
        assert env.turns[1].tokens[-1] == 3 or int(out.lengths[r]) == 7
        assert env.turns[1].truncated == (env.turns[1].tokens[-1] != 3)
    # The cache: 3 slots after the prompts hold a turn of 3 tokens, and no observation.
    short = dataclasses.replace(CONFIG, cache_length=PROMPTS.shape[1] + 3)
    envs = [Forever() for _ in range(rows)]
    out = run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, key, short, envs)
    np.testing.assert_array_equal(out.num_turns, [1] * rows)
    assert np.asarray(out.truncated).all() and (np.asarray(out.lengths) <= 3).all()
    assert all(env.turns[0].truncated == (env.turns[0].tokens[-1] != 3) for env in envs)


def test_observation_tokens_get_exactly_zero_gradient(episode, model):
    """A GRPO loss over an episode: the per-token scores of observation positions get a zero
    cotangent, so no parameter is pushed to predict an observation; even NaN or -inf there
    changes nothing; and yet observations stay in the context of later model tokens."""
    ep, _ = episode
    graphdef, params = model
    advantages = episode_advantages(ep.rewards, ep.turn_ids, group_size=GROUP, where=ep.where)

    def loss(token_logps, old_logps):
        per_token = policy_gradient_loss(token_logps, old_logps, advantages, where=ep.where)
        return aggregate(per_token, mode="seq_mean_token_mean", where=ep.where).mean()

    def scores(params, tokens):
        return completion_logps(graphdef, params, PROMPTS, PROMPT_WHERE, tokens,
                                ep.context_where, temperature=ep.temperature)  # fmt: skip

    logps = jax.jit(scores)(params, ep.tokens)
    value, grad = jax.value_and_grad(loss)(logps, ep.logps)
    observation = np.asarray(ep.roles) == Role.OBSERVATION
    assert observation.sum() > 4
    grad = np.asarray(grad)
    assert (grad[observation] == 0).all() and (grad[~np.asarray(ep.where)] == 0).all()
    pushed = np.asarray(ep.where) & (np.asarray(advantages) != 0)  # rows with an advantage
    assert pushed.sum() > 10 and (np.abs(grad[pushed]) > 0).all()
    # Poisoned observation positions: the same loss and gradient, bit for bit.
    poisoned = jnp.where(observation, jnp.nan, logps)
    old = jnp.where(observation, -jnp.inf, ep.logps)
    value2, grad2 = jax.value_and_grad(loss)(poisoned, old)
    assert value2 == value
    np.testing.assert_array_equal(grad2, grad)

    # Through the model: the parameters' gradient is finite and equals that of the loss with
    # the observation positions' scores cut off from it.
    def through_model(params, cut):
        token_logps = scores(params, ep.tokens)
        if cut:
            token_logps = jnp.where(observation, jax.lax.stop_gradient(token_logps), token_logps)
        return loss(token_logps, ep.logps)

    gradient = jax.jit(jax.grad(through_model), static_argnums=1)
    full, cut = gradient(params, False), gradient(params, True)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(cut), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        assert_close(a, b, rtol=1e-6, atol=1e-9)
    # Observations are context: changing one changes the scores of the model tokens after it.
    r, t = np.argwhere(observation & (np.asarray(ep.turn_ids) == 0))[0]
    changed = ep.tokens.at[r, t].set((ep.tokens[r, t] + 1) % MODEL_CONFIG.vocab_size)
    other = jax.jit(scores)(params, changed)
    later = np.asarray(ep.where)[r] & (np.arange(ep.tokens.shape[1]) > t)
    assert np.abs(np.asarray(other - logps)[r][later]).max() > 1e-3
    assert_close(np.asarray(other)[r, :t], np.asarray(logps)[r, :t])


def test_no_recompilation_across_calls(model, episode):
    graphdef, params = model
    sizes = [f._cache_size() for f in (episodes_module._start, episodes_module._turn,
                                       episodes_module._observe)]  # fmt: skip
    other = jax.tree.map(lambda x: x * 1.01, params)
    small = dataclasses.replace(CONFIG, max_tokens=9, max_turns=3)  # host-side limits only
    for p, key, config in ((other, 4, CONFIG), (params, 5, small)):
        out = run_episodes(graphdef, p, PROMPTS[::-1], PROMPT_WHERE[::-1], jax.random.key(key),
                           config, environments(), group_size=GROUP)  # fmt: skip
        check_layout(out, config)
    assert [f._cache_size() for f in (episodes_module._start, episodes_module._turn,
                                      episodes_module._observe)] == sizes  # fmt: skip


def test_the_same_key_reproduces_an_episode(model, episode):
    ep, _ = episode
    again = run_episodes(*model, PROMPTS, PROMPT_WHERE, jax.random.key(3), CONFIG,
                         environments(), group_size=GROUP)  # fmt: skip
    for a, b in zip(ep, again, strict=True):
        np.testing.assert_array_equal(a, b)
    other = run_episodes(*model, PROMPTS, PROMPT_WHERE, jax.random.key(4), CONFIG,
                         environments(), group_size=GROUP)  # fmt: skip
    assert (np.asarray(other.tokens) != np.asarray(ep.tokens)).any()
    # The G episodes of a prompt draw differently.
    assert (np.asarray(ep.tokens)[0] != np.asarray(ep.tokens)[1]).any()


def test_a_tool_episode_renders_back_to_its_ids():
    """A random model with the chat tokenizer and the calculator environment, drawing from a
    few tokens so that it opens tool calls (malformed ones: the errors come back as
    observations): what the episode holds is what the template renders for the conversation
    the environment recorded, turn after turn."""
    tok = chat_tokenizer()
    config = DecoderConfig(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, head_dim=8)  # fmt: skip
    graphdef, params = make_model(3, config)
    # Without <|im_end|> (this model would draw it first): turns end at </tool_call> or after
    # 8 tokens, and a turn without a call is the answer.
    allowed = {tok.tokenizer.token_to_id(t) for t in ("<tool_call>", "</tool_call>")}
    allowed |= set(tok.encode("1+ {"))
    forbidden = tuple(i for i in range(tok.vocab_size) if i not in allowed)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, stop_tokens=(tok.eos_id,),
                              forbidden_tokens=forbidden, pad_token=tok.pad_id)  # fmt: skip
    close = tok.tokenizer.token_to_id("</tool_call>")
    config = EpisodeConfig(sampling=sampling, max_turns=3, max_tokens=320,
                           max_observation_tokens=128, turn_end_sequences=((close,),))  # fmt: skip
    messages = [[{"role": "user", "content": "2+2?"}], [{"role": "user", "content": "(1)"}]]
    tools = [CALCULATOR.schema()]
    prompts = [
        tok.encode(render_chat_template(tok.chat_template, m, tools=tools,
                                        add_generation_prompt=True, **tok.special_tokens))
        for m in messages
    ]  # fmt: skip
    width = max(map(len, prompts))
    prompt_tokens = np.array([[tok.pad_id] * (width - len(p)) + p for p in prompts], np.int32)
    prompt_where = np.array([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    envs = [ToolEnvironment(tok, [CALCULATOR]) for _ in range(4)]
    ep = run_episodes(graphdef, params, prompt_tokens, prompt_where, jax.random.key(0), config,
                      envs, group_size=2, tokenizer=tok)  # fmt: skip
    check_layout(ep, config)
    assert int(ep.num_turns.max()) >= 2 and (np.asarray(ep.roles) == Role.OBSERVATION).any()
    for r, env in enumerate(envs):
        ids = prompts[r // 2] + np.asarray(ep.tokens)[r, : int(ep.lengths[r])].tolist()
        recorded = list(env.messages)
        while bool(ep.truncated[r]) and recorded[-1]["role"] == "tool":
            recorded.pop()  # answers to the last turn that a limit kept out of the episode
        text = render_chat_template(tok.chat_template, messages[r // 2] + recorded,
                                    tools=tools, **tok.special_tokens)  # fmt: skip
        rendered = tok.encode(text)
        assert rendered[: len(ids)] == ids
        # After the episode, only the template's end of turn.
        assert tok.decode(rendered[len(ids) :], stop_at_eos=False) in ("", "\n")
        assert sum(m["role"] == "assistant" for m in env.messages) == int(ep.num_turns[r])


def test_bad_configs_and_arguments_are_refused(model):
    graphdef, params = model
    key, envs = jax.random.key(0), environments(len(PROMPTS))
    cases = [
        (dict(sampling=dataclasses.replace(SAMPLING, cache_length=12)), ("sampling.cache_length",)),
        (dict(sampling="greedy"), ("sampling", "SamplingConfig")),
        (dict(max_turns=0), ("max_turns", ">= 1")),
        (dict(max_tokens=2.5), ("max_tokens", "int")),
        (dict(max_observation_tokens=0), ("max_observation_tokens",)),
        (dict(turn_end_sequences=((1, 2), ())), ("turn_end_sequences", "empty")),
        (dict(turn_end_sequences=(1, 2)), ("turn_end_sequences",)),
        (dict(turn_end_sequences="</tool_call>"), ("turn_end_sequences",)),
        (dict(turn_end_sequences=((1, -2),)), ("turn_end_sequences", "-2")),
        (dict(cache_length=1), ("cache_length", ">= 2")),
        (dict(step_timeout=0), ("step_timeout",)),
        (dict(step_timeout=float("inf")), ("step_timeout", "finite")),
    ]
    for changes, names in cases:
        with own_checks(), raises_naming(*names):
            EpisodeConfig(**{**dataclasses.asdict(CONFIG), "sampling": SAMPLING, **changes})
    with raises_naming("environments", "3", "6"):
        run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, key, CONFIG, envs, group_size=2)
    with raises_naming("cache_length", "5"):
        run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, key,
                     dataclasses.replace(CONFIG, cache_length=5), envs)  # fmt: skip
    with raises_naming("stop_tokens", "30"):
        run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, key, dataclasses.replace(
            CONFIG, sampling=dataclasses.replace(SAMPLING, stop_tokens=(30,))), envs)  # fmt: skip
    with raises_naming("prompt_where", "[1]"):
        run_episodes(
            graphdef,
            params,
            PROMPTS,
            PROMPT_WHERE & np.array([[1], [0], [1]], bool),
            key,
            CONFIG,
            envs,
        )
    with raises_naming("concrete", "jax.jit"):
        jax.jit(lambda p: run_episodes(graphdef, params, p, PROMPT_WHERE, key, CONFIG, envs))(
            PROMPTS
        )
    with raises_naming("EpisodeConfig"):
        run_episodes(graphdef, params, PROMPTS, PROMPT_WHERE, key, SAMPLING, envs)
    sliding = dataclasses.replace(MODEL_CONFIG, sliding_window=8)
    sliding_graphdef, sliding_params = make_model(0, sliding)
    with raises_naming("sliding_window=8", "cache_length"):
        run_episodes(sliding_graphdef, sliding_params, PROMPTS, PROMPT_WHERE, key, CONFIG, envs)


# The advantages of episodes and turns, against float64 references written from the formulas.


def reference_group(values, valid, group, *, scale, ddof, eps):
    """Group-relative advantages of flat `[R]` values, float64, loops over groups."""
    values = np.asarray(values, np.float64)
    valid = np.asarray(valid) & np.isfinite(values)
    out = np.zeros(len(values))
    total = values[valid]
    for start in range(0, len(values), group):
        rows = np.arange(start, start + group)
        rows = rows[valid[rows]]
        x = values[rows]
        if len(x) < 2 or x.max() == x.min():
            continue
        centered = x - x.mean()
        if scale == "none":
            out[rows] = centered
            continue
        pool = x if scale == "group" else total
        std = np.sqrt(((pool - pool.mean()) ** 2).sum() / (len(pool) - ddof))
        out[rows] = centered / (std + eps)
    return out


def reference_turns(turn_rewards, turn_ids, group, *, credit, scale, ddof, eps, where):
    rewards = np.asarray(turn_rewards, np.float64)
    rows, turns = rewards.shape
    exists = np.array([[(turn_ids[i] == k).any() for k in range(turns)] for i in range(rows)])
    q = np.zeros_like(rewards)
    for i in range(rows):
        for k in range(turns):
            if credit == "turn":
                q[i, k] = rewards[i, k] if exists[i, k] else 0.0
            else:
                q[i, k] = sum(rewards[i, j] for j in range(k, turns) if exists[i, j])
    a = np.stack([reference_group(q[:, k], exists[:, k], group, scale=scale, ddof=ddof, eps=eps)
                  for k in range(turns)], axis=1)  # fmt: skip
    out = np.zeros(turn_ids.shape)
    for i, t in np.argwhere(where & (turn_ids >= 0) & (turn_ids < turns)):
        out[i, t] = a[i, turn_ids[i, t]]
    return out


@st.composite
def episode_arrays(draw):
    # Fixed shapes (eager ops compile once per shape); groups of 1, 2, 3 or 6 rows.
    group = draw(st.sampled_from([1, 2, 3, 6]))
    rows, turns, width = 6, 3, 8
    turn_ids = np.full((rows, width), -1, np.int32)
    for i in range(rows):
        n = draw(st.integers(0, width))
        turn_ids[i, :n] = np.sort(draw(st.lists(st.integers(0, turns - 1), min_size=n, max_size=n)))
    values = st.sampled_from([0.0, 1.0, -2.0, 0.5, np.nan]) | st.floats(-3, 3, width=32)
    turn_rewards = np.array(draw(st.lists(values, min_size=rows * turns, max_size=rows * turns)),
                            np.float32).reshape(rows, turns)  # fmt: skip
    where = np.array(draw(st.lists(st.booleans(), min_size=rows * width, max_size=rows * width)))
    return group, turn_rewards, turn_ids, where.reshape(rows, width)


@given(episode_arrays(), st.sampled_from(["return", "turn"]),
       st.sampled_from(["group", "batch", "none"]), st.sampled_from([0, 1]))  # fmt: skip
def test_turn_advantages_match_the_reference(arrays, credit, scale, ddof):
    group, turn_rewards, turn_ids, where = arrays
    out = turn_advantages(turn_rewards, turn_ids, group_size=group, credit=credit, scale=scale,
                          ddof=ddof, eps=1e-4, where=where)  # fmt: skip
    expected = reference_turns(turn_rewards, turn_ids, group, credit=credit, scale=scale,
                               ddof=ddof, eps=1e-4, where=where)  # fmt: skip
    assert out.dtype == jnp.float32 and out.shape == turn_ids.shape
    assert_close(out, expected, rtol=1e-4, atol=1e-5)
    # Episode advantages: the group-relative outcome on every kept token.
    rewards = np.nansum(turn_rewards, axis=1)
    episode = episode_advantages(rewards, turn_ids, group_size=group, scale=scale, ddof=ddof,
                                 where=where)  # fmt: skip
    per_row = reference_group(rewards, np.ones(len(rewards), bool), group, scale=scale,
                              ddof=ddof, eps=1e-4)  # fmt: skip
    assert_close(episode, np.where(where & (turn_ids >= 0), per_row[:, None], 0.0), rtol=1e-4,
                 atol=1e-5)  # fmt: skip


def test_advantage_properties():
    turn_ids = np.array([[0, 0, 1, 1, -1], [0, 1, 1, 1, 1], [0, 0, 0, -1, -1], [0, 1, -1, -1, -1]])
    rewards = np.array([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.5, 0.5]], np.float32)
    # One reward at the last turn, every turn reached by the whole group: "return" is the
    # episode advantage on every token.
    last = np.array([[0.0, 1.0], [0.0, 3.0], [0.0, 2.0], [0.0, -1.0]], np.float32)
    both = np.array([[0, 1, 1, -1, -1]] * 4)
    assert_close(turn_advantages(last, both, group_size=2),
                 episode_advantages(last.sum(1), both, group_size=2), rtol=1e-6)  # fmt: skip
    # Zero mean per group and turn among the episodes that reached the turn.
    a = np.asarray(turn_advantages(rewards, turn_ids, group_size=2, credit="turn", scale="none"))
    assert a[0, 2] == 0.5 and a[1, 1] == -0.5 and a[0, 0] == a[1, 0] == 0  # turn 0 ties
    assert a[2, 0] == 0.25 and a[3, 0] == -0.25 and a[3, 1] == 0  # row 3's turn 1 is alone
    # Shift invariance; observation tokens masked out get exactly 0.
    shifted = turn_advantages(rewards + 5.0, turn_ids, group_size=2, credit="turn")
    assert_close(shifted, turn_advantages(rewards, turn_ids, group_size=2, credit="turn"),
                 atol=1e-5)  # fmt: skip
    model = turn_ids >= 0
    model[0, 1] = model[1, 3] = False
    masked = np.asarray(turn_advantages(rewards, turn_ids, group_size=2, where=model))
    assert masked[0, 1] == 0 and masked[1, 3] == 0 and (masked[turn_ids < 0] == 0).all()
    # Padding columns change nothing; nothing kept gives exactly 0.
    padded = np.concatenate([turn_ids, np.full((4, 3), -1)], axis=1)
    for fn, r in ((turn_advantages, rewards), (episode_advantages, rewards.sum(1))):
        assert_close(fn(r, padded, group_size=2)[:, :5], fn(r, turn_ids, group_size=2))
        assert (np.asarray(fn(r, padded, group_size=2))[:, 5:] == 0).all()
        none = fn(r, turn_ids, group_size=2, where=np.zeros(turn_ids.shape, bool))
        assert (np.asarray(none) == 0).all()
    # A NaN turn reward leaves the row out at that turn (and, crediting returns, before it).
    nan = rewards.copy()
    nan[1, 1] = np.nan
    out = np.asarray(turn_advantages(nan, turn_ids, group_size=2))
    assert np.isfinite(out).all() and (out[1] == 0).all() and (out[0] == 0).all()
    weighted = lambda r: (turn_advantages(r, turn_ids, group_size=2) * np.arange(5)).sum()  # noqa: E731
    grad = jax.grad(weighted)(jnp.asarray(nan).at[3, 0].set(0.2))  # rows 2, 3 differ
    assert np.isfinite(np.asarray(grad)).all() and np.asarray(grad)[2:].any()
    # bf16 rewards: within bf16 rounding of float32, computed in float32.
    bf16 = turn_advantages(jnp.asarray(rewards, jnp.bfloat16), turn_ids, group_size=2)
    assert bf16.dtype == jnp.float32
    assert_close(bf16, turn_advantages(rewards, turn_ids, group_size=2), atol=1e-2)
    bf16 = episode_advantages(jnp.asarray([1.3, 0.2, 0.7, 0.1], jnp.bfloat16), turn_ids,
                              group_size=2)  # fmt: skip
    assert bf16.dtype == jnp.float32
    assert_close(bf16, episode_advantages(np.array([1.3, 0.2, 0.7, 0.1]), turn_ids,
                                          group_size=2), atol=1e-2)  # fmt: skip


def test_advantages_under_jit_vmap_and_grad_without_recompiling():
    turn_ids = jnp.array([[0, 0, 1, 1, -1], [0, 1, 1, 1, 1], [0, 0, 0, -1, -1], [0, 1, -1, -1, -1]])
    rewards = jnp.array([[0.0, 1.0], [0.3, 0.0], [1.0, 0.0], [0.5, 0.5]])

    def turns(r, ids, eps):
        return turn_advantages(r, ids, group_size=2, eps=eps)

    def episodes(r, ids, eps):
        return episode_advantages(r.sum(1), ids, group_size=2, eps=eps)

    for fn in (turns, episodes):
        calls = [((rewards, turn_ids, jnp.float32(1e-4)), {}),
                 ((rewards * 2, turn_ids[::-1], jnp.float32(1e-3)), {})]  # fmt: skip
        assert_traced_once(fn, calls)
        stacked = jax.vmap(fn, in_axes=(0, 0, None))(
            jnp.stack([rewards, rewards[::-1]]), jnp.stack([turn_ids, turn_ids]), 1e-4
        )
        assert_close(stacked[1], fn(rewards[::-1], turn_ids, 1e-4))
        grad = jax.grad(lambda r, fn=fn: (fn(r, turn_ids, 1e-4) * jnp.arange(5.0)).sum())(rewards)
        assert np.isfinite(np.asarray(grad)).all() and np.abs(np.asarray(grad)).max() > 0


def test_advantages_refuse_bad_shapes_and_options():
    ids = np.zeros((4, 5), np.int32)
    with own_checks():
        with raises_naming("rewards", "(3,)", "(4,)"):
            episode_advantages(np.zeros(3), ids, group_size=2)
        with raises_naming("turn_rewards", "(4,)"):
            turn_advantages(np.zeros(4), ids, group_size=2)
        with raises_naming("turn_ids", "[B, T]"):
            turn_advantages(np.zeros((4, 2)), ids[0], group_size=2)
        with raises_naming("where"):
            turn_advantages(np.zeros((4, 2)), ids, group_size=2, where=np.ones((4, 4), bool))
        with raises_naming("credit", "'outcome'"):
            turn_advantages(np.zeros((4, 2)), ids, group_size=2, credit="outcome")
        with raises_naming("group_size=3", "4"):
            turn_advantages(np.zeros((4, 2)), ids, group_size=3)
        with raises_naming("scale"):
            episode_advantages(np.zeros(4), ids, group_size=2, scale="std")
