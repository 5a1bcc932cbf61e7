"""Where a run's time goes: each step split into compile, data wait, rollout, log-prob
recomputation, train, weight sync, checkpoint, eval and idle.

    with goodput.phase("rollout"):      # inside a recipe's step
        out = rollout.sample(...)

The loop times the data wait, the step, the evaluation and the checkpoint; a recipe's step
marks its rollouts, log-prob recomputations and weight syncs itself, and what remains of the
step is "train". Compilation is taken out of whichever phase it happened in, from JAX's own
compile-time events (tracing, lowering, XLA compilation). "idle" is the rest of the step's
wall time (logging, the progress bar). Times are the host's: a phase ends when the host has
its results (every step reads its metrics back, so the device's work lands in the step).
Goodput is the productive share (rollout, log-probs, train) of all the time.
"""

import contextlib
import time
from collections.abc import Iterator

import jax

PHASES: tuple[str, ...] = (
    "compile", "data", "rollout", "logprobs", "train", "sync", "checkpoint", "eval", "idle",
)  # fmt: skip
PRODUCTIVE: tuple[str, ...] = ("rollout", "logprobs", "train")
# What an interruption cost, on the first step after the restart (`kit.recovery`).
RECOVERY: tuple[str, ...] = ("lost_work", "detection", "restart", "restore", "recompile")
PREFIX = "time_"  # the metrics' keys: time_compile, time_data, ...
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class Clock:
    """Seconds spent per phase since `reset`, nested phases counted once (in the inner)."""

    def __init__(self):
        self.compiled = 0.0  # every compile second seen since the clock was made
        self.reset()

        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event in _COMPILE_EVENTS:
            self.compiled += duration

    def reset(self) -> None:
        self.spent = dict.fromkeys(PHASES, 0.0)
        self.started = time.perf_counter()
        self._open: list[dict[str, float]] = []  # the phases entered and not yet left

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; one of {PHASES}")
        frame = {"start": time.perf_counter(), "compiled": self.compiled,
                 "inner": 0.0, "inner_compile": 0.0}  # fmt: skip
        self._open.append(frame)
        try:
            yield
        finally:
            self._open.pop()
            total = time.perf_counter() - frame["start"]
            compiled = self.compiled - frame["compiled"]  # with the inner phases'
            own_compile = max(0.0, compiled - frame["inner_compile"])
            self.spent[name] += max(0.0, total - frame["inner"] - own_compile)
            self.spent["compile"] += own_compile
            if self._open:
                self._open[-1]["inner"] += total
                self._open[-1]["inner_compile"] += compiled

    def split(self) -> dict[str, float]:
        """This step's seconds per phase, idle being the wall time no phase accounts for."""
        wall = time.perf_counter() - self.started
        spent = dict(self.spent)
        spent["idle"] = max(0.0, wall - sum(v for k, v in spent.items() if k != "idle"))
        return spent


_clock: list[Clock] = []


def clock() -> Clock:
    """The process's clock (made on first use). One per process, by design: its compile-time
    listener is registered with `jax.monitoring`, which is process-wide and has no way to
    remove a listener, so a clock per run would leave every earlier run's listener counting."""
    if not _clock:
        _clock.append(Clock())
    return _clock[0]


def phase(name: str):
    """Time a block as `name` (one of `PHASES`) on the process's clock."""
    return clock().phase(name)


def logged_seconds(record: dict, phases: tuple[str, ...] = PHASES) -> float:
    """The seconds a logged step `record` spent in `phases` (default every phase)."""
    return sum(record.get(PREFIX + p, 0.0) for p in phases)


def totals(records: list[dict]) -> dict[str, float]:
    """Seconds per phase summed over the steps of `records`, with `goodput` (the productive
    share of all of it)."""
    spent = {p: sum(r.get(PREFIX + p, 0.0) for r in records) for p in PHASES}
    whole = sum(spent.values())
    productive = sum(spent[p] for p in PRODUCTIVE)
    return {
        **{p: round(v, 2) for p, v in spent.items()},
        "goodput": round(productive / whole, 4) if whole else 0.0,
    }


def plot_split(records: list[dict], path, title: str) -> None:
    """A stacked bar per step of its seconds per phase, into `path` (PNG); on the first step
    after a restart, hatched, what the interruption cost (`RECOVERY`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if PREFIX + "train" in r]
    if not steps:
        return
    fig, ax = plt.subplots(figsize=(7, 3.2))
    bottom = [0.0] * len(steps)
    x = [r["step"] for r in steps]
    restarted = any(PREFIX + name in r for r in steps for name in RECOVERY)
    for name in PHASES + (RECOVERY if restarted else ()):
        values = [r.get(PREFIX + name, 0.0) for r in steps]
        hatch = "//" if name in RECOVERY else None
        ax.bar(x, values, bottom=bottom, label=name, width=0.8, hatch=hatch)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("seconds", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, ncol=3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
