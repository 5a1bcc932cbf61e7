"""How often a run saves a checkpoint: every `--checkpoint-every` steps, or with `auto`, at
the interval that loses the least time, to checkpoints and to the work an interruption
throws away (Young 1974, Daly 2006):

    tau = sqrt(2 * C * M)

seconds of training between checkpoints, where C is the cost of one checkpoint (the seconds
a step waits for it: all of the save when it is synchronous, the copy off the devices when
it is asynchronous) and M the mean time between interruptions (MTTI). In steps,
n = max(1, round(tau / t)), t the seconds of a step (compilation and evaluation left out).

The run measures C with a checkpoint of its first step and t on its second, and prints the
interval in one line. M is the run's own MTTI once it has been interrupted (the seconds its
steps took over all its starts, the steps lost included, divided by its restarts; every
`--resume` counts), else `--mtti` (an hour by default).

References: J. W. Young, "A first order approximation to the optimum checkpoint interval",
CACM 1974; J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
restart dumps", FGCS 2006.
"""

import math

import numpy as np
from jax.experimental import multihost_utils

from kit import goodput

# The phases of a step that recur every step: a step's time for the interval.
RECURRING = ("data", "rollout", "logprobs", "train", "sync")


def young_daly_steps(cost: float, mtti: float, step_seconds: float) -> int:
    """The checkpoint interval in steps: `max(1, round(sqrt(2 * cost * mtti) / step_seconds))`.

    >>> young_daly_steps(0.5, 3600.0, 0.1)  # sqrt(3600) = 60 s of steps of 0.1 s
    600
    >>> young_daly_steps(2.0, 10.0, 30.0)  # a step longer than the interval: every step
    1
    """
    return max(1, round(math.sqrt(2.0 * cost * mtti) / max(step_seconds, 1e-9)))


def observed_mtti(seconds: float, restarts: int) -> float | None:
    """The mean time between interruptions of a run whose steps took `seconds` over all its
    starts, interrupted `restarts` times; None before its first interruption."""
    return seconds / restarts if restarts > 0 else None


def trained_seconds(records: list[dict], lost_seconds: float) -> float:
    """The seconds a run's steps took over all its starts: those of its logged steps (each
    one's phases), and those of the steps its restarts lost."""
    return sum(map(goodput.logged_seconds, records)) + lost_seconds


class Interval:
    """When to save: `every` steps (an int), or `"auto"`: a checkpoint at the first step
    measures its cost, the second step's time gives the Young/Daly interval (`measured`).

    `mtti` is the one to assume (`--mtti`, or the run's observed one, `observed`); in a run
    of several processes, process 0's interval is every process's, so that they all save
    the same steps.
    """

    def __init__(self, every: int | str, *, mtti: float, observed: bool = False):
        self.every = None if every == "auto" else every
        self.mtti = mtti
        self.observed = observed
        self.cost: float | None = None

    def observe(self, records: list[dict], badput: dict) -> None:
        """Take the run's observed MTTI, where it has one, from its records (those kept at a
        resume) and its `badput.json` (`restarts`, `lost_seconds`)."""
        seconds = trained_seconds(records, badput["lost_seconds"])
        mtti = observed_mtti(seconds, badput["restarts"])
        if mtti is not None and mtti > 0:
            self.mtti, self.observed = mtti, True

    def due(self, step: int) -> bool:
        """Whether to save after `step` (the last step and a stop save anyway)."""
        if self.every is None:  # auto: the first step's checkpoint measures the cost
            return self.cost is None
        return step % self.every == 0

    def measured(self, split: dict[str, float], saved: bool, processes: int) -> str | None:
        """Take a step's seconds per phase (`kit.goodput`), with whether it saved; once the
        auto interval is known, the line that says it (else None)."""
        if self.every is not None:
            return None
        if self.cost is None:
            self.cost = split.get("checkpoint", 0.0) if saved else None
            return None
        step_seconds = sum(split.get(p, 0.0) for p in RECURRING)
        every = young_daly_steps(self.cost, self.mtti, step_seconds)
        if processes > 1:  # process 0's, so that every process saves the same steps
            every = int(multihost_utils.broadcast_one_to_all(np.array(every)))
        self.every = every
        where = "observed" if self.observed else "assumed, --mtti"
        return (
            f"--checkpoint-every auto: every {every} steps: a checkpoint costs "
            f"{self.cost:.3g} s, a step {step_seconds:.3g} s, MTTI {self.mtti:.4g} s ({where}); "
            f"Young/Daly sqrt(2 x {self.cost:.3g} x {self.mtti:.4g}) = "
            f"{math.sqrt(2 * self.cost * self.mtti):.3g} s of steps"
        )
