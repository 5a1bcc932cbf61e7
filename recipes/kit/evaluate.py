"""Held-out evaluation: greedy accuracy with the task's verifier, and token-mean losses.

Sampling is split by rows over the run's devices (`kit.parallel`), in every process; each
process decodes every completion, so all compute the same accuracy.
"""

from collections.abc import Callable

import jax
import numpy as np

from tunelib import rollout

from kit.data import Task, prompts


def greedy_config(task: Task, vocab_size: int):
    """Greedy decoding up to `task.max_new_tokens`, stopping at the tokenizer's stop ids;
    embedding rows past the tokenizer's vocabulary are never sampled."""

    tok = task.tokenizer
    return rollout.SamplingConfig(
        max_new_tokens=task.max_new_tokens,
        temperature=0.0,
        stop_tokens=tuple(tok.stop_ids),
        pad_token=tok.pad_id,
        forbidden_tokens=tuple(range(tok.vocab_size, vocab_size)),
    )


def completions(
    graphdef, params, task: Task, records: list[dict], sampling, placed, key=None
) -> list[str]:
    """The decoded completions of the records' prompts under `sampling` (greedy by default),
    split over the devices of `placed` (a `kit.parallel.Placement`; None: as they come), in
    batches of at most 512 prompts (few distinct shapes to compile)."""

    key = jax.random.key(0) if key is None else key
    texts = []
    for first in range(0, len(records), 512):
        chunk = records[first : first + 512]
        tokens, where = prompts(task, chunk)
        if placed is not None:  # split over the devices, with copies of a prompt to fill them
            extra = -len(chunk) % placed.num_devices
            filled = [np.concatenate([x, np.repeat(x[:1], extra, 0)]) for x in (tokens, where)]
            tokens, where = placed.global_rows(tuple(filled))
        chunk_key = jax.random.fold_in(key, first)  # each chunk samples afresh
        out = rollout.sample(graphdef, params, tokens, where, chunk_key, sampling)
        rows = placed.fetch(out.tokens) if placed is not None else np.asarray(out.tokens)
        texts += [task.tokenizer.decode(row) for row in rows[: len(chunk)].tolist()]
    return texts


def accuracy(graphdef, params, task: Task, vocab_size: int, placed) -> float:
    """The share of held-out problems whose greedy completion the verifier accepts (sampled
    on the devices of `placed`, see `completions`)."""
    if not task.problems:
        return float("nan")
    greedy = greedy_config(task, vocab_size)
    texts = completions(graphdef, params, task, task.problems, greedy, placed)
    return float(np.mean([task.correct(t, r) for t, r in zip(texts, task.problems, strict=True)]))


def weighted_mean(metric: Callable, batches: list, weight: Callable) -> float:
    """The mean of `metric(batch)` over batches, each weighted by `weight(batch)` (tokens,
    rows): the exact mean over every held-out example."""
    weights = [float(weight(b)) for b in batches]
    if not sum(weights):
        return float("nan")
    total = sum(float(metric(b)) * w for b, w in zip(batches, weights, strict=True))
    return total / sum(weights)
