"""The log-probs of both sides of preference pairs, from one forward pass.

A padded preference batch has a `chosen` and a `rejected` side of `[B, T]` rows; a packed one
(`packing=True`) is one set of rows in which pair k is segments 2k + 1 (chosen) and 2k + 2
(rejected). Either way the result is per pair.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tunelib import logprobs

from kit import evaluate
from kit.data import Task


class PairLogps(NamedTuple):
    """Per pair `[P]`: the sequence log-probs (sums over the completion tokens) and their
    per-token means of each side, and `real`, False for the empty slots of packed rows and
    for rows of padding (no completion token)."""

    chosen: jax.Array
    rejected: jax.Array
    chosen_mean: jax.Array
    rejected_mean: jax.Array
    real: jax.Array


def pair_logps(
    graphdef, params, batch: dict, *, implementation: str, max_segments: int | None = None
) -> PairLogps:
    """`PairLogps` of a padded or packed preference batch under `params` (`max_segments`:
    the packed rows' bound, as the dataset was given)."""

    model = nnx.merge(graphdef, params)
    if "segment_ids" in batch:
        rows = batch
    else:  # chosen rows, then rejected rows
        rows = jax.tree.map(
            lambda c, r: jnp.concatenate([c, r]), batch["chosen"], batch["rejected"]
        )
    packed = {k: rows[k] for k in ("segment_ids", "positions") if k in rows}
    hidden = model(rows["tokens"], where=rows["attention_where"], **packed)
    token = logprobs.fused_token_logps(
        hidden, model.unembedding(), rows["targets"], where=rows["where"],
        softcap=model.config.final_logit_softcapping, implementation=implementation,
    )  # fmt: skip
    if not packed:
        sums = jnp.split(logprobs.sequence_sum(token, where=rows["where"]), 2)
        means = jnp.split(logprobs.sequence_mean(token, where=rows["where"]), 2)
        real = jnp.split(rows["where"].any(axis=1), 2)[0]  # rows of padding are no pairs
        return PairLogps(*sums, *means, real)
    segments = {"segment_ids": rows["segment_ids"], "num_segments": max_segments}
    sums = logprobs.sequence_sum(token, where=rows["where"], **segments)
    means = logprobs.sequence_mean(token, where=rows["where"], **segments)
    counts = logprobs.sequence_sum(rows["where"].astype(jnp.float32), **segments)

    def sides(x):  # [B, S] -> chosen [B * S / 2], rejected [B * S / 2]
        return x[:, 0::2].reshape(-1), x[:, 1::2].reshape(-1)

    return PairLogps(*sides(sums), *sides(means), sides(counts)[0] > 0)


def answer_of(side: str | list[dict]) -> str:
    """The answer a chosen completion gives: its text, or its assistant message's content."""
    return side[0]["content"] if isinstance(side, list) else side


def on_policy_pairs(
    task: Task,
    graphdef,
    params,
    vocab_size: int,
    placed,
    *,
    temperature: float = 0.0,
    seed: int = 0,
) -> Task:
    """`task` (the built-in one) with on-policy negatives: where the model answers a training
    prompt wrongly (greedily, or sampled at `temperature` > 0 with `seed`), the pair prefers
    the right answer over exactly that mistake; the other pairs keep their near miss."""

    sampling = evaluate.greedy_config(task, vocab_size)
    sampling = dataclasses.replace(sampling, temperature=temperature)
    key = jax.random.fold_in(jax.random.key(seed), 0x9A1)
    answers = evaluate.completions(graphdef, params, task, task.train, sampling, placed, key)
    # A chat model's pairs are assistant messages: its wrong reply becomes one too. A reply
    # may be as long as a sampled completion, so the sequences get room for one.
    chat = isinstance(task.train[0]["chosen"], list)

    def fits(reply: str) -> bool:
        return len(task.tokenizer.encode(reply)) <= task.max_new_tokens

    train = [
        {**pair, "rejected": [{"role": "assistant", "content": reply}] if chat else reply}
        if reply and fits(reply) and not task.correct(reply, {"answer": answer_of(pair["chosen"])})
        else pair
        for pair, reply in zip(task.train, map(str.strip, answers), strict=True)
    ]
    length = max(task.max_length, task.prompt_length + task.max_new_tokens + 3)
    return dataclasses.replace(task, train=train, max_length=length)
