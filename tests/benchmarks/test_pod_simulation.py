"""`benchmarks/pod_simulation.py`: the discrete-event model of the disaggregated loop against
its closed forms (every completion the same length), the properties its schedules imply on
long-tailed lengths, and the script end to end at its smallest settings."""

import numpy as np
import pytest

from tests.benchmarks._run import load_benchmark, refusal, run_benchmark

sim = load_benchmark("pod_simulation.py", "pod_simulation")


def pod(workers=4, slots=8, prompt=16, group=4, train_us=50.0, push_s=0.0, **kw):
    """A small pod; `train_us` the whole trainer's microseconds per token."""
    return sim.Pod(workers=workers, slots=slots, prompt=prompt, group=group,
                   train_s_per_token=train_us * 1e-6, push_s=push_s, **kw)  # fmt: skip


def same_tokens_each_batch(seed, p: "sim.Pod", batches: int, tail: float = 1.0):
    """Long-tailed lengths where every batch is a new order of the same lengths: each batch
    then has the same longest completion and the same tokens, and a step's costs repeat."""
    one = sim.completion_lengths(seed, p.batch, 24, tail, 400)
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.permutation(one) for _ in range(batches)])


@pytest.mark.parametrize(("workers", "slots", "length"), [(1, 1, 5), (4, 8, 37), (16, 64, 200)])
def test_synchronous_step_is_its_closed_form(workers, slots, length):
    p = pod(workers=workers, slots=slots, train_us=80.0)
    steps = 8
    result = sim.summarize(
        sim.static_batches(p, np.full(steps * p.batch, length), steps, 0), p, warmup=2
    )
    prefill = slots * p.prompt / np.interp(slots, sim.DECODE_BATCH, sim.PREFILL_TOKENS_PER_S)
    sample = prefill + length * np.interp(slots, sim.DECODE_BATCH, sim.DECODE_MS) / 1e3
    train = (p.batch * length + p.batch / p.group * p.prompt) * 80e-6
    assert result["seconds_per_step"] == pytest.approx(sample + train, rel=1e-12)
    # The trainer waits while the workers sample; the workers wait while it trains.
    assert result["trainer_idle"] == pytest.approx(sample / (sample + train), rel=1e-9)
    assert result["worker_idle"] == pytest.approx(train / (sample + train), rel=1e-9)
    assert result["slot_use"] == pytest.approx(1.0)
    assert (result["staleness_max"], result["dropped"]) == (0, 0.0)


@pytest.mark.parametrize("staleness", [1, 2, 3])
@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])  # training's cost over sampling's
def test_asynchronous_step_hides_the_shorter_role(staleness, share):
    """With training costing no more than sampling (T <= S), a step takes S, so the
    speed-up over synchronous is (S + T) / S: at most 2, and 2 when they cost the same."""
    p = pod(prompt=0)
    length, steps = 50, 10
    sample = length * p.decode_seconds(p.slots)
    p = pod(prompt=0, train_us=share * sample / (p.batch * length) * 1e6)
    lengths = np.full((steps + staleness) * p.batch, length)
    sync, stale = (
        sim.summarize(sim.static_batches(p, lengths, steps, s), p, warmup=staleness + 1)
        for s in (0, staleness)
    )
    speedup = sync["seconds_per_step"] / stale["seconds_per_step"]
    assert stale["seconds_per_step"] == pytest.approx(sample, rel=1e-9)
    assert speedup == pytest.approx(1 + share, rel=1e-9)
    assert speedup <= 2 + 1e-9
    assert stale["staleness_max"] == stale["staleness_mean"] == staleness


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("workers", "staleness", "push_s"), [(2, 1, 0.0), (8, 2, 0.05)])
def test_asynchronous_is_never_slower_than_synchronous(seed, workers, staleness, push_s):
    p = pod(workers=workers, train_us=30.0 + 40.0 * seed, push_s=push_s)
    steps = 12
    lengths = same_tokens_each_batch(seed, p, steps + staleness)
    sync, stale = (
        sim.summarize(sim.static_batches(p, lengths, steps, s), p, warmup=staleness + 1)
        for s in (0, staleness)
    )
    assert stale["seconds_per_step"] <= sync["seconds_per_step"] * (1 + 1e-12)
    assert stale["trainer_idle"] <= sync["trainer_idle"]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("staleness", [1, 2, 4])
def test_partial_rollouts_idle_the_trainer_less_within_the_bound(seed, staleness):
    p = pod(workers=4, slots=8, push_s=0.01)
    steps = 16
    lengths = sim.completion_lengths(seed, 4 * steps * p.batch, 24, 1.0, 400)
    stale = sim.summarize(sim.static_batches(p, lengths, steps, staleness), p, warmup=4)
    run = sim.PartialRollouts(p, lengths, steps, staleness)
    trace = run.run()
    partial = sim.summarize(trace, p, warmup=4)
    assert partial["trainer_idle"] <= stale["trainer_idle"]
    # No trained token is more than s updates old, in any step, warm-up included.
    assert max(step[4] for step in trace.steps) <= staleness
    assert 0 <= partial["staleness_mean"] <= partial["staleness_max"] <= staleness
    assert len(trace.steps) == steps
    # A worker does one thing at a time: its stretches of work never overlap.
    worker, start, end = (np.array(column) for column in trace.work[:3])
    for w in range(p.workers):
        order = np.lexsort((end[worker == w], start[worker == w]))
        begins, ends = start[worker == w][order], end[worker == w][order]
        assert (ends >= begins).all() and (begins[1:] >= ends[:-1] - 1e-12).all()
    # Every token made was trained, dropped, is waiting to be, or is in a slot.
    waiting = sum(record[3] for record in run.finished)
    in_slots = sum(int(w.made[w.seq >= 0].sum()) for w in run.workers)
    trained = sum(step[3] for step in trace.steps)
    assert trained + trace.dropped + waiting + in_slots == trace.generated


def test_same_seed_same_numbers():
    p = pod(workers=3, slots=4, push_s=0.02)

    def run(seed):
        lengths = sim.completion_lengths(seed, 4 * 10 * p.batch, 24, 1.0, 400)
        return sim.simulate(p, lengths, steps=10, warmup=3, staleness=2)

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_smallest_settings_end_to_end(tmp_path):
    args = ["--workers", "2", "--slots", "4", "--tails", "1.0", "--steps", "6", "--warmup", "2"]
    result, output = run_benchmark("pod_simulation.py", *args, out=tmp_path)
    assert result["benchmark"] == "pod_simulation"
    (row,) = result["results"]
    assert (row["workers"], row["tail"]) == (2, 1.0)
    for mode in ("async", "partial"):
        ratio = row[mode]["steps_per_s"] / row["sync"]["steps_per_s"]
        assert row[f"speedup_{mode}"] == pytest.approx(ratio)
    assert row["push_s"] == pytest.approx(2.472 * 8 / 100)
    # The calibration: with the runs' own seconds as costs, synchronous is their sum.
    rows = {(r["run"], r["variant"]): r for r in result["calibration"]}
    assert len(rows) == 6
    first = rows[("table 1 (16 new tokens)", "s = 0")]
    assert first["predicted"] == pytest.approx(0.053 + 0.348 + 0.009)
    assert first["measured"] == 0.414
    assert "calibration" in output


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slots", "65"], "--slots: 1 to 64"),
        (["--warmup", "6", "--steps", "6"], "--warmup must be >= 1 and < --steps"),
        (["--tails", "wide"], "--workers and --tails: comma-separated numbers"),
    ],
)
def test_bad_flags_end_in_one_line(argv, message):
    assert message in refusal("pod_simulation.py", *argv)
