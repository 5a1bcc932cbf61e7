r"""Held-out evaluation: greedy accuracy with the task's verifier, and token-mean losses.

Sampling is split by rows over the run's devices (`kit.parallel`), in every process; each
process decodes every completion, so all compute the same accuracy.

An RL run also compares each evaluation with its first, problem by problem: the problems the
policy now answers right that the starting policy got wrong (`turned_right`) and the reverse
(`turned_wrong`). Both accuracies are measured on the same problems, so the noise of their
difference is the paired (McNemar) standard error, $\sqrt{(b + c)/n - (b - c)^2/n^2} /
\sqrt{n}$ for $b$ turned right and $c$ turned wrong of $n$, which `paired_headline` reports
beside the accuracies; it is smaller than two independent binomial errors when the two
policies agree on most problems.
"""

import json
import math
from collections.abc import Callable

import jax
import numpy as np

from tunelib import metrics, rollout

from kit.data import Task, prompt_inputs
from kit.images import model_inputs
from kit.runs import read_record


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
    return [
        task.tokenizer.decode(row)
        for tokens, _, _ in _sampled(graphdef, params, task, records, sampling, placed, key, 1)
        for row in tokens.tolist()
    ]


def _sampled(graphdef, params, task: Task, records, sampling, placed, key, group_size: int):
    """`(tokens, where, logps)` NumPy rows of `group_size` completions of each record's prompt
    (row `r * G + g`), chunk by chunk of at most 512 prompts."""
    key = jax.random.key(0) if key is None else key
    for first in range(0, len(records), 512):
        chunk = records[first : first + 512]
        # Split over the devices, with copies of a prompt to fill them.
        extra = 0 if placed is None else -len(chunk) % placed.num_devices
        tokens, where, pixels = prompt_inputs(task, chunk + chunk[:1] * extra)
        if placed is not None:
            tokens, where, pixels = placed.global_rows((tokens, where, pixels))
        images = None if pixels is None else model_inputs(pixels)
        chunk_key = jax.random.fold_in(key, first)  # each chunk samples afresh
        out = rollout.sample(
            graphdef, params, tokens, where, chunk_key, sampling, group_size=group_size,
            images=images,
        )  # fmt: skip
        fetch = placed.fetch if placed is not None else np.asarray
        rows = len(chunk) * group_size
        yield tuple(fetch(x)[:rows] for x in (out.tokens, out.where, out.logps))


# The metrics of `samples` below, in the order they are logged.
SAMPLED = (
    "pass_at_1", "pass_at_k", "maj_at_k", "sample_entropy", "distinct_completions",
    "distinct_2grams",
)  # fmt: skip


def samples(graphdef, params, task: Task, sampling, placed, *, k: int) -> dict:
    r"""Held-out metrics of `k` completions of each problem drawn with `sampling` (the
    rollouts' temperature and filters), the first signs of entropy collapse:

    - `pass_at_1`: the share of correct samples; `pass_at_k` (Chen et al. 2021's unbiased
      estimator at n = k: some sample correct) and `maj_at_k` (the most frequent answer
      correct), averaged over problems (`tunelib.metrics`);
    - `sample_entropy`: the mean over sampled tokens of $-\log \pi(y_t)$ under the sampled
      (tempered) distribution, a Monte Carlo estimate of its per-token entropy;
    - `distinct_completions` and `distinct_2grams`: the share of distinct completions and of
      distinct token bigrams in each problem's k samples, averaged.
    """
    if not task.problems:
        return dict.fromkeys(SAMPLED, float("nan"))
    key = jax.random.key(1)  # the same draws at every evaluation: curves without key noise
    parts = list(_sampled(graphdef, params, task, task.problems, sampling, placed, key, k))
    tokens, where, logps = (np.concatenate(x) for x in zip(*parts, strict=True))
    texts = [task.tokenizer.decode(row) for row in tokens.tolist()]
    records = [r for r in task.problems for _ in range(k)]
    correct = np.array([task.correct(t, r) for t, r in zip(texts, records, strict=True)], bool)
    return sample_metrics(tokens, where, logps, correct, [t.strip() for t in texts], k=k)


def sample_metrics(tokens, where, logps, correct, answers: list, *, k: int) -> dict:
    """The metrics of `samples` from `[P * k, T]` sampled `tokens` (row `p * k + j` is sample
    j of problem p), their mask and behaviour log-probs, whether each is `correct`, and each
    one's answer (anything hashable: equal answers count as one vote for maj@k)."""
    numbered = np.empty(len(answers), np.int32)  # each problem's distinct answers, numbered
    for start in range(0, len(answers), k):
        seen: dict = {}
        for i in range(start, start + k):
            numbered[i] = seen.setdefault(answers[i], len(seen))
    grid = (len(answers) // k, k)
    correct = np.asarray(correct, bool)
    return {
        "pass_at_1": float(correct.mean()),
        "pass_at_k": float(metrics.pass_at_k(correct.reshape(grid), k=k).mean()),
        "maj_at_k": float(
            metrics.majority_at_k(numbered.reshape(grid), correct.reshape(grid), k=k).mean()
        ),
        "sample_entropy": float(-logps[where].mean()) if where.any() else float("nan"),
        "distinct_completions": float(
            metrics.distinct_completions(tokens, group_size=k, where=where).mean()
        ),
        "distinct_2grams": float(
            np.nanmean(metrics.distinct_ngrams(tokens, n=2, group_size=k, where=where))
        ),
    }


def rl_metric_names(config) -> list[str]:
    """The names `for_rl`'s evaluation logs under `config`."""
    return ["accuracy", "turned_right", "turned_wrong", *(SAMPLED if config.eval_samples else ())]


def for_rl(
    config, graphdef, vocab_size: int, policy_of: Callable, task: Task, sampling, placed, run
) -> Callable[[dict], dict]:
    """The held-out evaluation of an RL recipe, `evaluate(trainable) -> metrics`: greedy
    `accuracy`, the problems `turned_right` and `turned_wrong` since the first evaluation,
    and with `--eval-samples k` the metrics of `samples` drawn with `sampling`, on the policy
    the sampler runs, `policy_of(trainable)` (`kit.lora.Tuning.policy`: adapters beside the
    base, never merged). The first evaluation's grades are kept in the folder of `run`
    (`kit.runs.RunFolder`; written by process 0), where a resumed run reads them; a resumed
    run without them logs NaN for the two counts."""
    path = run.path / START_GRADES
    start: list[np.ndarray | None] = []

    def first_grades(now: np.ndarray) -> np.ndarray | None:
        if not start and run.resume:  # the run's first evaluation was an earlier process's
            start.append(start_grades(path))
        if not start:  # this is the run's first evaluation, before the first step
            if jax.process_index() == 0:
                path.write_text(json.dumps(now.astype(int).tolist()))
            start.append(now)
        first = start[0]
        return first if first is not None and first.shape == now.shape else None

    def evaluate(trainable) -> dict:
        policy = policy_of(trainable)
        if not task.problems:
            out = dict.fromkeys(("accuracy", "turned_right", "turned_wrong"), float("nan"))
        else:
            now = graded(graphdef, policy, task, vocab_size, placed)
            first = first_grades(now)
            out = {"accuracy": float(now.mean())}
            out["turned_right"] = float("nan") if first is None else float(np.sum(now & ~first))
            out["turned_wrong"] = float("nan") if first is None else float(np.sum(first & ~now))
        if config.eval_samples:
            out.update(samples(graphdef, policy, task, sampling, placed, k=config.eval_samples))
        return out

    return evaluate


def graded(graphdef, params, task: Task, vocab_size: int, placed) -> np.ndarray:
    """Whether the verifier accepts the greedy completion of each held-out problem, `[n]`
    booleans in the order of `task.problems` (sampled on the devices of `placed`, see
    `completions`)."""
    greedy = greedy_config(task, vocab_size)
    texts = completions(graphdef, params, task, task.problems, greedy, placed)
    return np.array([task.correct(t, r) for t, r in zip(texts, task.problems, strict=True)], bool)


def accuracy(graphdef, params, task: Task, vocab_size: int, placed) -> float:
    """The share of held-out problems whose greedy completion the verifier accepts."""
    if not task.problems:
        return float("nan")
    return float(graded(graphdef, params, task, vocab_size, placed).mean())


# The run folder's file of the first evaluation's grades, one 0 or 1 per held-out problem.
START_GRADES = "heldout_start.json"


def start_grades(path) -> np.ndarray | None:
    """The first evaluation's grades kept in `path`, or None when the file is gone or damaged
    (`kit.runs.read_record`: the counts against the first evaluation are then NaN, and the
    result line leaves the paired comparison out)."""

    def check(grades) -> np.ndarray:
        if not isinstance(grades, list) or any(g not in (0, 1) for g in grades):
            raise ValueError("not a list of 0s and 1s")
        return np.array(grades, bool)

    consequence = "the problems turned right and wrong since the first evaluation are not counted"
    return read_record(path, check, consequence)


def paired_headline(run) -> dict:
    """The result line's paired comparison of the last evaluation with the first:
    `heldout_turned_right`, `heldout_turned_wrong` and `heldout_paired_se` (the standard
    error of `accuracy_after - accuracy_before`, module docstring); `{}` when the run did
    not log them (no held-out problems, or a run resumed from a folder without its
    `heldout_start.json`) or the file is gone."""
    last = [r for r in run.records() if "turned_right" in r]
    start = run.path / START_GRADES
    counts = ("turned_right", "turned_wrong")
    if not last or not all(math.isfinite(last[-1][k]) for k in counts) or not start.is_file():
        return {}
    grades = start_grades(start)
    if grades is None:
        return {}
    right, wrong = int(last[-1]["turned_right"]), int(last[-1]["turned_wrong"])
    n = len(grades)
    spread = (right + wrong) / n - ((right - wrong) / n) ** 2
    return {
        "heldout_turned_right": right,
        "heldout_turned_wrong": wrong,
        "heldout_paired_se": round(math.sqrt(max(spread, 0.0) / n), 4),
    }


def pair_mean(metric: Callable, batches: list) -> float:
    """The mean of `metric(batch)` over the preference pairs of held-out `batches`, each batch
    weighted by its pairs (rows of padding, with no chosen token, weigh nothing)."""
    return weighted_mean(metric, batches, lambda b: b["chosen"]["where"].any(axis=1).sum())


def weighted_mean(metric: Callable, batches: list, weight: Callable) -> float:
    """The mean of `metric(batch)` over batches, each weighted by `weight(batch)` (tokens,
    rows): the exact mean over every held-out example."""
    weights = [float(weight(b)) for b in batches]
    if not sum(weights):
        return float("nan")
    total = sum(float(metric(b)) * w for b, w in zip(batches, weights, strict=True))
    return total / sum(weights)
