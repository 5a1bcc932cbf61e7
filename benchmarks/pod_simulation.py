"""The disaggregated GRPO loop at pod scale, simulated: one trainer and W rollout workers,
synchronous, asynchronous with staleness s, and asynchronous with partial rollouts, on the
same completion lengths. A discrete-event model in Python and NumPy, not a measurement: what
it predicts follows from the measured figures it is given and the assumptions below.

    python benchmarks/pod_simulation.py                    # W 8, 32, 128, 256; tails 0.5, 1.0
    python benchmarks/pod_simulation.py --push delta --staleness 4
    python benchmarks/pod_simulation.py --workers 2 --slots 4 --tails 1.0 --steps 6 \
        --warmup 2                                         # seconds: what the tests run

The model. A step trains on a batch of N = W x `--slots` completions. A worker (one chip)
decodes `--slots` sequences at once, every decode step at the measured step time of that
batch size (`tunelib.rollout.sample`'s loop has a fixed shape, so a step costs the same
however many rows have stopped), after prefilling their prompts at the measured prefill
rate. The trainer trains
on a batch in a time proportional to its tokens (prompts once per group, completions
unpadded), then pushes the weights: `--push full` or `delta` bytes over `--push-gbps`,
the trainer busy for the push, the workers receiving in the background (a second copy of
the weights) and switching to the new ones when their mode says. Completion lengths are
lognormal (`--median`, `--tails`: the sigma of the log), rounded up, at most `--cap`.

- sync (the recipe's `--max-staleness 0`): at each step the workers sample their shares of
  the batch with the newest weights, each to its longest completion; the trainer waits for
  every share, trains, pushes; the workers wait for the push.
- async, staleness s (the recipe's schedule, `recipes/kit/disaggregated.py`): the trainer
  and the workers meet once a step; during step t the workers sample batch t + s with the
  weights of step t - 1 while the trainer trains on batch t, so a step takes the longer of
  the two, then the push. Overlapping hides the shorter of sampling and training, for any
  s >= 1; s sets only how old the batches are.
- partial: a worker keeps its slots full, starting a new prompt in a slot as soon as its
  sequence ends (paying that prompt's prefill), and at every push interrupts its unfinished
  sequences, switches weights and continues them, paying a prefill of each one's prompt and
  tokens so far (its KV cache, computed with the old weights, is made again). Every token
  is tagged with the version that made it. A step trains on N finished sequences whose
  oldest token is at most s updates old, those with the oldest first tokens first; a
  sequence that can no longer meet that bound is dropped, and its tokens are counted. New
  sequences start only while fewer than (u + s + 1) N are in flight or trained at version
  u (AReaL's rule), u the newest version.

Inputs (`--help` names each; the defaults are the measured figures):

- decode ms a step and prefill tokens/s at batch 1, 8, 16, 32, 64: `sampler_roofline.py`
  on one TPU v5e, a Llama-3.2-1B-shaped bf16 decoder, prompts of 128 tokens
  (benchmarks/README.md, `accelerator_suite.sh`, the third run on a v5e);
- the trainer's seconds per token: SmolLM2-135M's GRPO step (LoRA rank 16) on the v5e,
  9.12 s of training in 60 steps of 16 x 40 prompt and 128 x 8 completion positions
  (docs/tpu.md; docs/recipes/smollm2.md, "The budget"), for `--trainer-share` trainer chips
  per rollout worker, scaling linearly;
- the push: the Llama-3.2-1B shape's 2.472 GB of bf16 weights, a delta 0.08 of them (the
  toy model's full fine-tuning at learning rate 1e-6, `weight_delta.py`).

Then the calibration: the same model at the size of `async_grpo.py`'s measured runs (one
trainer, one sampler, 32 prompts x 8 samples, its measured rollout, train, log-prob and sync
seconds as inputs) against those runs' measured step times. Prints a table and one JSON line
(`--json-out` writes it to a file too).
"""

import argparse
import dataclasses
import heapq
import itertools
import math
import sys
from pathlib import Path

import numpy as np

from _measure import print_result  # beside this script, first on sys.path

# sampler_roofline.py on a v5e (benchmarks/README.md, the third run on a v5e): batch sizes,
# decode ms a step, prefill tokens/s.
DECODE_BATCH = (1, 8, 16, 32, 64)
DECODE_MS = (3.702, 4.253, 4.854, 6.002, 8.954)
PREFILL_TOKENS_PER_S = (26_588.0, 75_805.0, 85_249.0, 87_999.0, 86_515.0)
# SmolLM2's GRPO on a v5e, train seconds over steps and token positions (docs/tpu.md): 91.3.
TRAIN_US_PER_TOKEN = 9.12 / 60 / (16 * 40 + 128 * 8) * 1e6
# Llama-3.2-1B's bf16 weights (GB), and a bf16 delta's share of them (weight_delta.py).
WEIGHT_GB, DELTA_SHARE = 2.472, 0.08
# async_grpo.py, base model, 32 prompts x 8 samples, pinned (benchmarks/README.md, tables 1
# and 2): the inputs from the s = 0 run, the correction's log-probs from the s = 1 run, and
# the measured seconds a step of each run.
MEASURED_RUNS = {
    "table 1 (16 new tokens)": {
        "new_tokens": 16, "rollout": 0.053, "train": 0.348, "sync": 0.009, "logprobs": 0.051,
        "measured": {"s = 0": 0.414, "s = 1": 0.412, "s = 1, no correction": 0.389},
    },
    "table 2 (48 new tokens)": {
        "new_tokens": 48, "rollout": 0.089, "train": 0.338, "sync": 0.008, "logprobs": 0.055,
        "measured": {"s = 0": 0.442, "s = 1": 0.443, "s = 1, no correction": 0.384},
    },
}  # fmt: skip
WORKER, ARRIVAL = 0, 1  # event kinds; at one time a worker's event comes first


@dataclasses.dataclass(frozen=True)
class Pod:
    """One trainer and `workers` rollout workers of `slots` sequences each, and their costs:
    a decode step at a batch size (`decode_ms` at `decode_batch`, linearly interpolated), a
    prefill (`prefill_tokens_per_s` at those batch sizes), the trainer's seconds per token
    (`correction_s_per_token` more in the asynchronous modes: the recomputed log-probs of
    the importance correction) and a push's seconds."""

    workers: int
    slots: int
    prompt: int
    group: int
    train_s_per_token: float
    push_s: float
    correction_s_per_token: float = 0.0
    decode_batch: tuple = DECODE_BATCH
    decode_ms: tuple = DECODE_MS
    prefill_tokens_per_s: tuple = PREFILL_TOKENS_PER_S

    @property
    def batch(self) -> int:
        """N, the completions a step trains on."""
        return self.workers * self.slots

    def decode_seconds(self, rows: int) -> float:
        """A decode step of a batch of `rows`."""
        return float(np.interp(rows, self.decode_batch, self.decode_ms)) / 1e3

    def prefill_seconds(self, tokens: float, rows: int) -> float:
        """A prefill of `tokens` in all over `rows` rows."""
        if tokens == 0:
            return 0.0
        return tokens / float(np.interp(rows, self.decode_batch, self.prefill_tokens_per_s))

    def train_seconds(self, completion_tokens: float, sequences: int, asynchronous: bool):
        """A train step on `sequences` completions of `completion_tokens` in all."""
        tokens = completion_tokens + sequences / self.group * self.prompt
        extra = self.correction_s_per_token if asynchronous else 0.0
        return tokens * (self.train_s_per_token + extra)


class Trace:
    """What a simulated run did: when each train step ended, the trainer's busy seconds in
    it (training and push) and the staleness of what it trained; each stretch of a worker's
    work; the tokens made, and those dropped."""

    def __init__(self):
        self.steps = []  # (end, trainer busy s, token staleness summed, tokens, max, sequences)
        self.work = ([], [], [], [], [])  # worker, start, end, tokens made, decoding or not
        self.generated = 0
        self.dropped = 0

    def worked(self, worker, start, end, tokens, decoding: bool) -> None:
        """A stretch of work of one worker (scalars) or of several (arrays)."""
        columns = np.broadcast_arrays(worker, start, end, tokens)
        for column, values in zip(self.work[:4], columns, strict=True):
            column.extend(values.ravel().tolist())
        self.work[4].extend([decoding] * columns[0].size)


def completion_lengths(seed: int, count: int, median: float, tail: float, cap: int):
    """`count` lognormal completion lengths: median `median`, sigma of the log `tail`,
    rounded up, from 1 to `cap` tokens. A longer draw of the same seed extends a shorter."""
    draws = np.random.default_rng(seed).lognormal(math.log(median), tail, size=count)
    return np.clip(np.ceil(draws), 1, cap).astype(np.int64)


def static_batches(pod: Pod, lengths: np.ndarray, steps: int, staleness: int) -> Trace:
    """Modes sync (`staleness` 0) and async, the recipe's schedule: batch j is sequences
    [j N, (j + 1) N), each worker decoding its `slots` of them from their prefill to the
    longest. Step t begins when the trainer and every worker meet (the push of step t - 1);
    with s = 0 the workers sample batch t, then the trainer trains on it; with s >= 1 the
    workers sample batch t + s with the weights of step t - 1 while the trainer trains on
    batch t (the first s batches are sampled, in turn, before step 0)."""
    batches = steps + staleness
    shares = lengths[: batches * pod.batch].reshape(batches, pod.workers, pod.slots)
    prefill = pod.prefill_seconds(pod.slots * pod.prompt, pod.slots)
    # [batch, worker]: seconds from a batch's start to the end of each worker's share
    done = prefill + shares.max(axis=-1) * pod.decode_seconds(pod.slots)
    tokens = shares.sum(axis=-1)
    now, trace = 0.0, Trace()

    def sample(batch: int, at: float) -> float:
        workers, starts = np.arange(pod.workers), np.full(pod.workers, at)
        trace.worked(workers, starts, starts + prefill, 0, decoding=False)
        trace.worked(workers, starts + prefill, at + done[batch], tokens[batch], decoding=True)
        trace.generated += int(tokens[batch].sum())
        return float(done[batch].max())

    for batch in range(staleness):
        now += sample(batch, now)
    for j in range(steps):
        sampling = sample(j + staleness, now)
        train = pod.train_seconds(tokens[j].sum(), pod.batch, staleness > 0)
        busy = train + pod.push_s
        now += (sampling + busy) if staleness == 0 else (max(sampling, train) + pod.push_s)
        stale = min(j, staleness)
        trace.steps.append((now, busy, stale * tokens[j].sum(), tokens[j].sum(), stale, pod.batch))
    return trace


class _Worker:
    """A worker of the partial mode: its slots (sequence id, -1 when empty; tokens left;
    tokens made; version of the oldest token; the versions of its tokens summed), the
    weights' version it holds, when its current run of decode steps began (`clock`) and
    the number of its scheduled event (older ones are stale)."""

    def __init__(self, slots: int):
        self.seq = np.full(slots, -1)
        self.left = np.zeros(slots, np.int64)
        self.made = np.zeros(slots, np.int64)
        self.oldest = np.zeros(slots, np.int64)
        self.versions = np.zeros(slots, np.int64)
        self.version, self.clock, self.epoch = 0, 0.0, 0


class PartialRollouts:
    """Mode partial: workers that keep their slots full and switch weights at every push,
    and a trainer that takes the N oldest finished sequences within the staleness bound."""

    def __init__(self, pod: Pod, lengths: np.ndarray, steps: int, staleness: int):
        self.pod, self.lengths, self.steps, self.staleness = pod, lengths, steps, staleness
        self.step_s = pod.decode_seconds(pod.slots)
        self.workers = [_Worker(pod.slots) for _ in range(pod.workers)]
        self.events, self.order = [], itertools.count()
        self.finished = []  # heap: (oldest version, finish time, id, tokens, versions summed)
        self.version, self.training, self.started, self.lost = 0, False, 0, 0
        self.trace = Trace()

    def run(self) -> Trace:
        """Events in time order until the push of the last step has arrived."""
        for w in range(self.pod.workers):
            self.refill(w)
            self.schedule(w)
        while self.version < self.steps:
            now, kind, _, w, epoch = heapq.heappop(self.events)
            if kind == ARRIVAL:
                self.arrive(now)
            elif epoch == self.workers[w].epoch:
                self.finish(w, now)
            self.train(now)
        return self.trace

    def decode(self, w: int, count: int, until: float) -> None:
        """Worker `w` makes `count` tokens in each busy slot, from its clock to `until`."""
        worker = self.workers[w]
        busy = worker.seq >= 0
        worker.left[busy] -= count
        worker.made[busy] += count
        worker.versions[busy] += count * worker.version
        self.trace.generated += count * int(busy.sum())
        self.trace.worked(w, worker.clock, until, count * int(busy.sum()), decoding=True)
        worker.clock = until

    def finish(self, w: int, now: float) -> None:
        """Worker `w`'s next sequences end at `now`: to the trainer, and new ones started."""
        worker = self.workers[w]
        busy = worker.seq >= 0
        self.decode(w, int(worker.left[busy].min()), now)
        for i in np.flatnonzero(busy & (worker.left == 0)):
            record = (int(worker.oldest[i]), now, int(worker.seq[i]), int(worker.made[i]))
            heapq.heappush(self.finished, (*record, int(worker.versions[i])))
            worker.seq[i] = -1
        self.refill(w)
        self.schedule(w)

    def arrive(self, now: float) -> None:
        """The weights of the step just trained reach every worker at `now`: each abandons
        the decode step it is in, drops the sequences too stale for any later batch, prefills
        the rest again (prompt and tokens so far) with the new weights, and fills its slots."""
        self.training = False
        self.version += 1
        for w, worker in enumerate(self.workers):
            busy = worker.seq >= 0
            if now > worker.clock and busy.any():
                done = math.floor((now - worker.clock) / self.step_s)
                self.decode(w, min(done, int(worker.left[busy].min()) - 1), now)
        if self.version == self.steps:
            return
        bound = self.version - self.staleness
        while self.finished and self.finished[0][0] < bound:
            self.drop(heapq.heappop(self.finished)[3])
        for worker in self.workers:
            stale = (worker.seq >= 0) & (worker.oldest < bound)
            self.drop(int(worker.made[stale].sum()), sequences=int(stale.sum()))
            worker.seq[stale] = -1
        for w, worker in enumerate(self.workers):
            worker.version = self.version
            busy = worker.seq >= 0
            tokens = int((self.pod.prompt + worker.made[busy]).sum())
            start = max(now, worker.clock)
            worker.clock = start + self.pod.prefill_seconds(tokens, int(busy.sum()))
            self.trace.worked(w, start, worker.clock, 0, decoding=False)
            self.refill(w)
            self.schedule(w)

    def drop(self, tokens: int, sequences: int = 1) -> None:
        """Sequences that can no longer be trained within the bound, and their tokens."""
        self.trace.dropped += tokens
        self.lost += sequences

    def refill(self, w: int) -> None:
        """Worker `w` starts new sequences in its empty slots, as many as the rule on
        sequences in flight allows, and prefills their prompts."""
        worker = self.workers[w]
        allowed = (self.version + self.staleness + 1) * self.pod.batch
        empty = np.flatnonzero(worker.seq < 0)[: max(allowed - (self.started - self.lost), 0)]
        if empty.size == 0:
            return
        if self.started + empty.size > self.lengths.size:
            raise RuntimeError("the completion lengths ran out: draw more")
        ids = np.arange(self.started, self.started + empty.size)
        self.started += empty.size
        worker.seq[empty], worker.left[empty] = ids, self.lengths[ids]
        worker.made[empty], worker.versions[empty] = 0, 0
        worker.oldest[empty] = worker.version
        start = worker.clock
        worker.clock += self.pod.prefill_seconds(empty.size * self.pod.prompt, empty.size)
        self.trace.worked(w, start, worker.clock, 0, decoding=False)

    def schedule(self, w: int) -> None:
        """Worker `w`'s next event: when its next sequence ends (none while it is empty)."""
        worker = self.workers[w]
        worker.epoch += 1
        busy = worker.seq >= 0
        if busy.any():
            at = worker.clock + int(worker.left[busy].min()) * self.step_s
            heapq.heappush(self.events, (at, WORKER, next(self.order), w, worker.epoch))

    def train(self, now: float) -> None:
        """The trainer starts a step at `now` if it is free and N sequences are waiting."""
        if self.training or self.version == self.steps or len(self.finished) < self.pod.batch:
            return
        j = self.version
        batch = [heapq.heappop(self.finished) for _ in range(self.pod.batch)]
        tokens = sum(record[3] for record in batch)
        stale = sum(j * record[3] - record[4] for record in batch)
        worst = j - min(record[0] for record in batch)
        busy = self.pod.train_seconds(tokens, len(batch), True) + self.pod.push_s
        end = now + busy
        self.trace.steps.append((end, busy, stale, tokens, worst, len(batch)))
        self.training = True
        heapq.heappush(self.events, (end, ARRIVAL, next(self.order), -1, 0))


def summarize(trace: Trace, pod: Pod, warmup: int) -> dict:
    """A run's figures over its steps after the first `warmup` (the pipeline filled), from
    the end of step `warmup` - 1 to the end of the last (work that straddles either end
    counts for its part inside, its tokens pro rata): steps a second, the trainer's and the
    workers' idle shares, the share of the workers' slot steps that made a token, tokens
    made a second, the token staleness of what was trained (mean and most), the share of
    all tokens made that were dropped, and the mean length of the completions trained."""
    steps = np.array(trace.steps[warmup:], dtype=float)
    low, high = trace.steps[warmup - 1][0], trace.steps[-1][0]
    window = high - low
    _, start, end, tokens, decoding = (np.array(column) for column in trace.work)
    overlap = np.clip(np.minimum(end, high) - np.maximum(start, low), 0.0, None)
    span = np.where(end > start, end - start, 1.0)
    made = float((tokens * overlap / span).sum())
    decode_steps = overlap[decoding.astype(bool)].sum() / pod.decode_seconds(pod.slots)
    return {
        "steps_per_s": len(steps) / window,
        "seconds_per_step": window / len(steps),
        "trainer_idle": 1.0 - float(steps[:, 1].sum()) / window,
        "worker_idle": max(0.0, 1.0 - float(overlap.sum()) / (pod.workers * window)),
        "slot_use": made / (decode_steps * pod.slots) if decode_steps else 0.0,
        "tokens_per_s": made / window,
        "staleness_mean": float(steps[:, 2].sum() / steps[:, 3].sum()),
        "staleness_max": int(steps[:, 4].max()),
        "dropped": trace.dropped / trace.generated,
        "trained_length": float(steps[:, 3].sum() / steps[:, 5].sum()),
    }


def simulate(pod: Pod, lengths, *, steps: int, warmup: int, staleness: int) -> dict:
    """The three modes on the same lengths: their figures, and the speed-ups over sync."""
    out = {
        "sync": summarize(static_batches(pod, lengths, steps, 0), pod, warmup),
        "async": summarize(static_batches(pod, lengths, steps, staleness), pod, warmup),
        "partial": summarize(PartialRollouts(pod, lengths, steps, staleness).run(), pod, warmup),
    }
    for mode in ("async", "partial"):
        out[f"speedup_{mode}"] = out[mode]["steps_per_s"] / out["sync"]["steps_per_s"]
    return out


def calibration(steps: int = 20, warmup: int = 4) -> list[dict]:
    """The model at the size of `async_grpo.py`'s measured runs (1 trainer, 1 sampler of 256
    rows, every completion `new_tokens` long, its measured seconds as the costs) against
    those runs' measured seconds a step."""
    rows = []
    for name, run in MEASURED_RUNS.items():
        tokens = 256 * run["new_tokens"]
        pod = Pod(
            workers=1, slots=256, prompt=0, group=8, train_s_per_token=run["train"] / tokens,
            push_s=run["sync"], correction_s_per_token=run["logprobs"] / tokens,
            decode_batch=(1,), decode_ms=(run["rollout"] / run["new_tokens"] * 1e3,),
            prefill_tokens_per_s=(math.inf,),
        )  # fmt: skip
        lengths = np.full((steps + 1) * pod.batch, run["new_tokens"])
        variants = {
            "s = 0": (pod, 0),
            "s = 1": (pod, 1),
            "s = 1, no correction": (dataclasses.replace(pod, correction_s_per_token=0.0), 1),
        }
        predicted = {
            label: summarize(static_batches(p, lengths, steps, s), p, warmup)["seconds_per_step"]
            for label, (p, s) in variants.items()
        }
        for label, measured in run["measured"].items():
            rows.append({
                "run": name, "variant": label, "predicted": predicted[label],
                "measured": measured, "error": predicted[label] / measured - 1,
                "predicted_speedup": predicted["s = 0"] / predicted[label],
                "measured_speedup": run["measured"]["s = 0"] / measured,
            })  # fmt: skip
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", default="8,32,128,256", help="comma-separated W")
    p.add_argument("--tails", default="0.5,1.0", help="comma-separated sigmas of log length")
    p.add_argument("--slots", type=int, default=32, help="sequences a worker decodes at once")
    p.add_argument("--median", type=float, default=64, help="median completion tokens")
    p.add_argument("--cap", type=int, default=1024, help="most completion tokens")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--group", type=int, default=16, help="completions per prompt")
    p.add_argument("--staleness", type=int, default=1, help="s of the asynchronous modes")
    p.add_argument("--train-us-per-token", type=float, default=TRAIN_US_PER_TOKEN,
                   help="a trainer chip's microseconds per token trained")  # fmt: skip
    p.add_argument("--trainer-share", type=float, default=1.0,
                   help="trainer chips per rollout worker")  # fmt: skip
    p.add_argument("--push", choices=("full", "delta"), default="full")
    p.add_argument("--push-gbps", type=float, default=100.0, help="the push's Gbit/s")
    p.add_argument("--steps", type=int, default=40, help="train steps simulated")
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, default=None)
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked: a bad one ends in one line (exit status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.workers = [int(x) for x in args.workers.split(",") if x]
        args.tails = [float(x) for x in args.tails.split(",") if x]
    except ValueError:
        parser.error("--workers and --tails: comma-separated numbers")
    if not args.workers or min(args.workers) < 1 or not args.tails or min(args.tails) <= 0:
        parser.error("--workers: at least one, each >= 1; --tails: at least one, each > 0")
    if not 1 <= args.slots <= DECODE_BATCH[-1]:
        parser.error(f"--slots: 1 to {DECODE_BATCH[-1]}, the measured batch sizes")
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be >= 1 and < --steps")
    if args.staleness < 1 or min(args.median, args.cap, args.prompt, args.group) < 1:
        parser.error("--staleness, --median, --cap, --prompt and --group must be >= 1")
    if min(args.train_us_per_token, args.trainer_share, args.push_gbps) <= 0:
        parser.error("--train-us-per-token, --trainer-share and --push-gbps must be > 0")
    return args


def pod_results(args) -> list[dict]:
    """Every W and tail of the flags, the three modes each."""
    push_gb = WEIGHT_GB * (DELTA_SHARE if args.push == "delta" else 1.0)
    results = []
    for workers, tail in itertools.product(args.workers, args.tails):
        pod = Pod(
            workers=workers, slots=args.slots, prompt=args.prompt, group=args.group,
            train_s_per_token=args.train_us_per_token * 1e-6 / (args.trainer_share * workers),
            push_s=push_gb * 8 / args.push_gbps,
        )  # fmt: skip
        count = 3 * args.steps * pod.batch
        lengths = completion_lengths(args.seed, count, args.median, tail, args.cap)
        modes = simulate(pod, lengths, steps=args.steps, warmup=args.warmup,
                         staleness=args.staleness)  # fmt: skip
        results.append({"workers": workers, "tail": tail, "push_s": pod.push_s, **modes})
    return results


def print_tables(results: list[dict], rows: list[dict]) -> None:
    """The pod's figures, one line per mode, then the calibration."""
    print(f"{'W':>4s} {'tail':>5s} {'mode':8s} {'steps/s':>7s} {'s/step':>7s} "
          f"{'trainer idle':>12s} {'worker idle':>11s} {'slot use':>8s} {'tokens/s':>10s} "
          f"{'staleness':>9s} "
          f"{'max':>3s} {'dropped':>7s} {'length':>6s} {'speed-up':>8s}")  # fmt: skip
    for r in results:
        for mode in ("sync", "async", "partial"):
            m = r[mode]
            speedup = r.get(f"speedup_{mode}", 1.0)
            print(f"{r['workers']:4d} {r['tail']:5.2f} {mode:8s} {m['steps_per_s']:7.3f} "
                  f"{m['seconds_per_step']:7.3f} "
                  f"{m['trainer_idle']:12.1%} {m['worker_idle']:11.1%} {m['slot_use']:8.1%} "
                  f"{m['tokens_per_s']:10,.0f} {m['staleness_mean']:9.2f} "
                  f"{m['staleness_max']:3d} {m['dropped']:7.1%} {m['trained_length']:6.1f} "
                  f"{speedup:7.2f}x")  # fmt: skip
    print("\ncalibration: async_grpo.py, 1 trainer and 1 sampler, 32 prompts x 8 samples")
    print(f"{'run':24s} {'variant':22s} {'predicted s':>11s} {'measured s':>10s} "
          f"{'error':>7s} {'speed-up predicted':>18s} {'measured':>8s}")  # fmt: skip
    for r in rows:
        print(f"{r['run']:24s} {r['variant']:22s} {r['predicted']:11.3f} {r['measured']:10.3f} "
              f"{r['error']:7.1%} {r['predicted_speedup']:17.2f}x "
              f"{r['measured_speedup']:7.2f}x")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    results, rows = pod_results(args), calibration()
    print_tables(results, rows)
    inputs = {k: v for k, v in vars(args).items() if k != "json_out"}
    inputs.update(decode_batch=DECODE_BATCH, decode_ms=DECODE_MS,
                  prefill_tokens_per_s=PREFILL_TOKENS_PER_S, weight_gb=WEIGHT_GB,
                  delta_share=DELTA_SHARE)  # fmt: skip
    result = {"benchmark": "pod_simulation", "inputs": inputs, "results": results,
              "calibration": rows}  # fmt: skip
    print_result(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
