"""The largest batch that fits: a search that compiles each candidate batch size."""

from collections.abc import Callable
from typing import Any, NamedTuple

from tunelib import _validation as v
from tunelib.memory._plan import check_device_memory


class BatchSearch(NamedTuple):
    """The outcome of `largest_batch`.

    Attributes:
      size: the largest batch size that fits (0 when even the smallest does not).
      plan: its plan, what `plan_at` returned (None when none fits).
      peaks: every batch size compiled during the search -> its peak bytes.
    """

    size: int
    plan: Any
    peaks: dict[int, int]


def largest_batch(
    plan_at: Callable[[int], Any],
    *,
    device_memory: int,
    start: int,
    multiple_of: int = 1,
    max_size: int = 2**20,
) -> BatchSearch:
    r"""The largest batch size whose step fits in `device_memory`, each candidate compiled.

    `plan_at(b)` plans the step at batch size $b$ (for instance `memory_plan(step, state,
    resize_batch(batch, b), ...)`). The search brackets the largest fitting size between one
    that fits and one that does not, then narrows the bracket until they are
    `multiple_of` apart. Each new candidate is where the line through the two nearest
    compiled peaks reaches `device_memory` (peak memory grows about linearly with the
    batch, so this takes a few compilations), kept strictly inside the bracket; the result
    is checked, not extrapolated: its plan fits and the next size's does not. It assumes
    that the peak does not decrease as the batch grows.

    Args:
      plan_at: batch size -> its `MemoryPlan` (or any plan with an int `peak_bytes`, as
        the plan of a step made of several compiled functions).
      device_memory: bytes per device.
      start: the first size compiled (the run's batch size), a multiple of `multiple_of`.
      multiple_of: candidates are its multiples (the number of devices a batch splits over).
      max_size: the largest size considered; returned when it fits.

    Returns:
      A `BatchSearch`: the size, its plan and every peak compiled.

    Raises:
      ValueError: for sizes that are not positive multiples of `multiple_of`, or
        `start > max_size`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from tunelib.memory import largest_batch, memory_plan
      >>> w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
      >>> def plan_at(b):
      ...     x = jax.ShapeDtypeStruct((b, 256), jnp.float32)
      ...     return memory_plan(lambda w, x: jnp.tanh(x @ w) @ w, w, x)
      >>> found = largest_batch(plan_at, device_memory=2**20, start=64, multiple_of=8)
      >>> found.size, found.plan.peak_bytes <= 2**20 < found.peaks[found.size + 8]
      (256, True)

    References:
      JAX, "Ahead-of-time lowering and compilation", https://docs.jax.dev/en/latest/aot.html.
    """
    check_device_memory(device_memory)
    for name, value in (("start", start), ("multiple_of", multiple_of), ("max_size", max_size)):
        v.static_int(value, name)
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")
    if start % multiple_of or max_size < start:
        raise ValueError(
            f"start must be a multiple of multiple_of={multiple_of} and <= max_size="
            f"{max_size}, got {start}."
        )
    plans: dict[int, Any] = {}

    def peak(size: int) -> int:
        if size not in plans:
            plans[size] = plan_at(size)
        return plans[size].peak_bytes

    top = max_size // multiple_of * multiple_of
    if peak(start) <= device_memory:
        fits, over = start, None
    elif start == multiple_of or peak(multiple_of) > device_memory:
        return _found(0, plans)
    else:
        fits, over = multiple_of, start
    while over is None:  # grow: aim where the line through the last two peaks crosses
        if fits == top:
            return _found(fits, plans)
        sizes = sorted(s for s in plans if s <= fits)[-2:]
        guess = _crossing(plans, *sizes, device_memory, multiple_of) if len(sizes) == 2 else None
        candidate = min(top, 2 * fits if guess is None else max(guess, fits + multiple_of))
        fits, over = (candidate, None) if peak(candidate) <= device_memory else (fits, candidate)
    turn = 0
    while over - fits > multiple_of:  # narrow the bracket, strictly inside it
        guess = _crossing(plans, fits, over, device_memory, multiple_of)
        if guess is None or turn % 3 == 2:  # a bisection now and then, should the line miss
            guess = (fits + over) // 2 // multiple_of * multiple_of
        candidate = min(max(guess, fits + multiple_of), over - multiple_of)
        fits, over = (candidate, over) if peak(candidate) <= device_memory else (fits, candidate)
        turn += 1
    return _found(fits, plans)


def _crossing(plans: dict, low: int, high: int, memory: int, multiple: int) -> int | None:
    """The multiple of `multiple` (rounded down) where the line through the peaks compiled
    at `low` and `high` reaches `memory`; None when the line does not rise."""
    slope = (plans[high].peak_bytes - plans[low].peak_bytes) / (high - low)
    if slope <= 0:
        return None
    return int((low + (memory - plans[low].peak_bytes) / slope) // multiple * multiple)


def _found(size: int, plans: dict[int, Any]) -> BatchSearch:
    peaks = {s: p.peak_bytes for s, p in sorted(plans.items())}
    return BatchSearch(size, plans.get(size), peaks)
