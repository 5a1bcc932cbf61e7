"""The tool-use recipe: its flags, what its steps train on, and a short run end to end."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.recipes._scripts import recipe_main, recipe_module, run_without_jax
from tests.recipes.test_recipes import shared_compilation_cache


@pytest.fixture(autouse=True)
def _shared_compilation_cache():
    with shared_compilation_cache():
        yield


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--sft-steps", "10", "--steps", "10"], "--sft-steps 10 leaves no GRPO step"),
        (["--tool", "abacus"], "argument --tool: invalid choice: 'abacus'"),
        (["--max-turns", "1"], "--max-turns must be >= 2, got 1"),
        (["--group-size", "1"], "--group-size must be >= 2, got 1"),
        (["--num-demonstrations", "5000"], "--num-demonstrations 5000 is more than"),
        (["--temperature", "0"], "--temperature must be > 0, got 0.0"),
        (["--model", "no/such/model"], "--model no/such/model: no such file or folder"),
    ],
)
def test_bad_flags_give_one_line_without_jax(flags, line, tmp_path):
    out = run_without_jax("tool_use", *flags, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and line in lines[0], out.stderr
    assert not list(tmp_path.iterdir())


def _task(tool: bool):
    from kit import episodes

    config = types.SimpleNamespace(
        seed=0, num_train=16, num_heldout=4, max_digits=3, operations="*"
    )
    return episodes.load_task(config, episodes.chat_tokenizer(), tool=tool, max_turns=3)


def test_demonstrations_are_the_environments_episodes():
    """A tool demonstration is the call, the tool's answer as the environment renders it,
    and the answer; only the call and the answer (each with EOS) are model tokens."""
    from tunelib.rollout import CALCULATOR, ToolEnvironment, Turn

    from kit import episodes

    task = _task(tool=True)
    tok = task.tokenizer
    record = task.train[3]
    demo = episodes.demonstrations(task, [record])
    call = [*tok.encode(episodes.tool_call(record["problem"])), tok.eos_id]
    answer = [*tok.encode(record["answer"]), tok.eos_id]
    env = ToolEnvironment(tok, [CALCULATOR])
    env.reset(())
    observation = list(env.step(Turn(tuple(call), None, False)).observation)
    expected = call + observation + answer
    n = len(expected)
    assert demo["tokens"][0, :n].tolist() == expected
    assert not demo["context_where"][0, n:].any() and demo["context_where"][0, :n].all()
    model = np.zeros(n, bool)
    model[: len(call)] = True
    model[len(call) + len(observation) :] = True
    assert demo["where"][0, :n].tolist() == model.tolist()
    a, b = record["problem"].split("*")
    assert str(int(a) * int(b)) == record["answer"]
    assert tok.decode(observation).strip().splitlines()[1] == record["answer"]


def _model(vocab_size: int, **fields):
    from flax import nnx

    from tunelib.models import Decoder, DecoderConfig

    config = DecoderConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, **fields,
    )  # fmt: skip
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
    return graphdef, nnx.to_pure_dict(state)


def _sampled_episodes(task):
    """The task's episodes as the recipe samples them, at temperature 1."""
    from tunelib.rollout import EpisodeConfig, SamplingConfig

    tok = task.tokenizer
    return EpisodeConfig(
        sampling=SamplingConfig(max_new_tokens=task.turn_tokens, temperature=1.0,
                                stop_tokens=tuple(tok.stop_ids), pad_token=tok.pad_id),
        max_turns=task.max_turns, max_tokens=task.episode_tokens,
        max_observation_tokens=task.observation_tokens,
    )  # fmt: skip


def test_grpo_trains_on_the_sampled_tokens():
    """The GRPO batch holds a sampled episode's tokens exactly, its model-token mask and
    its behaviour log-probs, which are the recipe's own scores of those tokens."""
    from tunelib.rollout import Role, run_episodes

    from kit import episodes

    recipe = recipe_module("tool_use")
    task = _task(tool=True)
    tok = task.tokenizer
    graphdef, params = _model(tok.vocab_size)
    records, group = task.train[:2], 2
    demo = episodes.demonstrations(task, records)
    config = _sampled_episodes(task)
    envs = episodes.environments(task, records, group)
    episode = run_episodes(
        graphdef, params, demo["prompt_tokens"], demo["prompt_where"], jax.random.key(3),
        config, envs, group_size=group, tokenizer=tok,
    )  # fmt: skip
    batch = recipe.episode_batch(task, records, episode, group)
    np.testing.assert_array_equal(batch["tokens"], np.asarray(episode.tokens))
    np.testing.assert_array_equal(batch["where"], np.asarray(episode.roles) == Role.MODEL)
    np.testing.assert_array_equal(batch["context_where"], np.asarray(episode.context_where))
    np.testing.assert_array_equal(batch["logps"], np.asarray(episode.logps))
    turn_ids = np.asarray(episode.turn_ids)
    for row, env in enumerate(envs):  # the environment read the very tokens of the batch
        first = batch["tokens"][row][batch["where"][row] & (turn_ids[row] == 0)]
        assert tok.decode(first) == env.messages[0]["content"]
    scored = np.asarray(recipe.scores(graphdef, params, batch))
    np.testing.assert_allclose(np.where(batch["where"], scored, 0.0), batch["logps"], atol=2e-5)


def test_grpo_replays_the_episodes_routing():
    """With `--replay-routing` the GRPO batch carries the episodes' routing, cut with the
    batch to the prompt's and the used columns, and the recipe's scores route by it: they
    equal the behaviour log-probs, and another routing moves them."""
    from tunelib.rollout import run_episodes

    from kit import episodes

    recipe = recipe_module("tool_use")
    task = _task(tool=True)
    tok = task.tokenizer
    graphdef, params = _model(tok.vocab_size, num_experts=4, num_experts_per_tok=2,
                              norm_topk_prob=True)  # fmt: skip
    records, group = task.train[:2], 2
    demo = episodes.demonstrations(task, records)
    config = _sampled_episodes(task)
    episode = run_episodes(
        graphdef, params, demo["prompt_tokens"], demo["prompt_where"], jax.random.key(5),
        config, episodes.environments(task, records, group), group_size=group, tokenizer=tok,
        record_routing=True,
    )  # fmt: skip
    batch = recipe.trimmed(recipe.episode_batch(task, records, episode, group), 10_000)
    width, prompt = batch["tokens"].shape[1], task.prompt_length
    assert width < task.episode_tokens and batch["routing"].shape == (4, prompt + width, 1, 2)
    np.testing.assert_array_equal(
        batch["routing"], np.asarray(episode.routing)[:, : prompt + width]
    )
    where = batch["where"]
    scored = np.asarray(recipe.scores(graphdef, params, batch))
    np.testing.assert_allclose(np.where(where, scored, 0.0), batch["logps"], atol=2e-5)
    other = {**batch, "routing": (batch["routing"] + 1) % 4}
    moved = np.asarray(recipe.scores(graphdef, params, other))
    assert np.abs(moved - scored)[where].max() > 1e-3


def test_replay_routing_needs_a_mixture_of_experts(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        recipe_main("tool_use", ["--replay-routing", "--out", str(tmp_path / "run")])
    assert stop.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--replay-routing replays the experts of" in lines[0], lines


def test_grpo_never_trains_on_observations():
    """Episodes of a call, the tool's answer and an answer, through the recipe's GRPO batch
    and loss: the advantages and the loss's gradient are exactly 0 on the observation tokens
    and on padding, and nonzero on every model token."""
    from tunelib.rollout import Episode, Role

    from kit import episodes

    recipe = recipe_module("tool_use")
    task = _task(tool=True)
    graphdef, params = _model(task.tokenizer.vocab_size)
    records, group = task.train[:2], 2
    demo = {k: np.repeat(x, group, 0) for k, x in episodes.demonstrations(task, records).items()}
    where, context = demo["where"], demo["context_where"]
    observation = context & ~where
    turn = np.cumsum(np.diff(where.astype(int), prepend=0, axis=1) == 1, axis=1) - 1
    roles = np.where(where, Role.MODEL, np.where(observation, Role.OBSERVATION, Role.PADDING))
    scored = np.asarray(recipe.scores(graphdef, params, demo))
    rows = len(where)
    episode = Episode(
        tokens=demo["tokens"], roles=roles.astype(np.int8), where=where, context_where=context,
        logps=np.where(where, scored, 0.0).astype(np.float32),
        turn_ids=np.where(context, turn, -1).astype(np.int32),
        turn_starts=np.zeros((rows, 3), np.int32), turn_ends=np.zeros((rows, 3), np.int32),
        turn_rewards=np.zeros((rows, 3), np.float32),
        rewards=np.array([1.0, 0.0, 0.0, 1.0], np.float32), num_turns=np.full(rows, 2),
        lengths=context.sum(1), truncated=np.zeros(rows, bool), failed=np.zeros(rows, bool),
        temperature=np.float32(1.0),
    )  # fmt: skip
    batch = recipe.episode_batch(task, records, episode, group)
    assert (batch["advantages"][~where] == 0).all()
    assert (batch["advantages"][where] != 0).all()
    grads = np.asarray(
        jax.grad(lambda logps: recipe.grpo_loss(logps, batch, epsilon=0.2))(jnp.asarray(scored))
    )
    assert observation.any(axis=1).all()
    assert (grads[~where] == 0).all()
    assert (grads[where] != 0).all()


def test_sft_never_trains_on_observations():
    """In the recipe's own SFT loss a demonstration's observation tokens get exactly no
    gradient, its model tokens all get one, and the observations still change the scores of
    the model tokens after them (they are context)."""
    recipe = recipe_module("tool_use")
    task = _task(tool=True)
    graphdef, params = _model(task.tokenizer.vocab_size)
    from kit import episodes

    demo = recipe.trimmed(episodes.demonstrations(task, task.train[:3]), task.episode_tokens)
    observation = demo["context_where"] & ~demo["where"]
    assert observation.any(axis=1).all()
    scored = recipe.scores(graphdef, params, demo)
    grads = np.asarray(jax.grad(lambda logps: recipe.sft_loss(logps, demo))(scored))
    assert (grads[~demo["where"]] == 0).all() and (grads[demo["where"]] < 0).all()
    changed = dict(demo, tokens=np.where(observation, 5, demo["tokens"]))
    rescored = recipe.scores(graphdef, params, changed)
    after = demo["where"] & (np.cumsum(observation, axis=1) > 0)
    assert not np.allclose(np.asarray(scored)[after], np.asarray(rescored)[after])
    before = demo["where"] & (np.cumsum(observation, axis=1) == 0)
    np.testing.assert_allclose(np.asarray(scored)[before], np.asarray(rescored)[before], atol=1e-5)


@pytest.mark.slow
def test_recipe_trains_end_to_end(tmp_path):
    """A capped run: SFT steps lower the demonstrations' loss, the GRPO steps sample
    episodes and log their tool use, and the result holds the table's numbers."""
    out = tmp_path / "run"
    result = recipe_main(
        "tool_use",
        [
            "--steps", "5", "--sft-steps", "3", "--eval-every", "5", "--num-train", "32",
            "--num-heldout", "8", "--batch-size", "4", "--group-size", "2",
            "--num-demonstrations", "8", "--model-size", "student", "--max-digits", "2",
            "--sft-learning-rate", "1e-2", "--no-progress", "--no-plots", "--devices", "1",
            "--eval-samples", "2", "--out", str(out),
        ],
    )  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if 1 <= r["step"] <= 3]
    assert losses[-1] < losses[0]
    grpo = [r for r in records if r["step"] > 3]
    assert len(grpo) == 2 and all("sample_tool_call_rate" in r for r in grpo)
    assert all(0.0 <= r["reward"] <= 1.0 for r in grpo)
    for key in ("accuracy", "tool_call_rate", "malformed_rate", "turns"):
        assert f"{key}_before" in result and f"{key}_after" in result
    assert 1.0 <= result["turns_after"] <= 3.0
    # Two sampled episodes of each held-out problem at every evaluation: pass@1 <= pass@2.
    for when in ("before", "after"):
        assert 0 <= result[f"pass_at_1_{when}"] <= result[f"pass_at_k_{when}"] <= 1
        assert result[f"sample_entropy_{when}"] > 0
    assert (out / "model" / "config.json").is_file()
    assert (out / "model" / "tokenizer.json").is_file()
