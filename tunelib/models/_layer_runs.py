r"""How a decoder of layers of several shapes is scanned: in runs of a repeated pattern.

`scan_layers=True` stacks layers of one shape on a leading axis and runs them with one scan.
When the layers are not all of one shape (Gemma 4's sliding and wider full layers, a
mixture-of-experts model's dense first layers), they are cut into at most three runs: an
unrolled prefix, a pattern of $p$ layers repeated $R$ times, and the $r < p$ layers left
after the last whole pattern. A run of period $p$ keeps one stack per position in the
pattern, each with a leading axis of its $R$ repeats, and is one scan over the repeats whose
body applies its $p$ layers in order; the prefix and the rest are runs of one repeat. The
model compiles $a + p + r$ layer bodies, whatever its depth: the prefix $a$, the period $p$
and the rest $r$ are chosen to make that the fewest.
"""

from collections.abc import Hashable, Sequence
from typing import NamedTuple


class LayerRun(NamedTuple):
    """Layers `start`, ..., `start + period * repeats - 1`, scanned over `repeats` with a body
    of `period` layers: position `j` of repeat `r` is layer `start + r * period + j`."""

    start: int
    period: int
    repeats: int

    def members(self, position: int) -> tuple[int, ...]:
        """The layers at `position` of the pattern, one per repeat: one stack's layers."""
        return tuple(self.start + r * self.period + position for r in range(self.repeats))


def layer_runs(kinds: Sequence[Hashable]) -> tuple[LayerRun, ...]:
    """The runs to scan layers of these `kinds` (anything comparable; layers of one kind can
    share a stack) in: one run of period 1 when every layer is of one kind, else the prefix,
    pattern and rest that compile the fewest layer bodies (the shortest prefix, then the
    shortest period, among equals)."""
    kinds = tuple(kinds)
    n = len(kinds)
    best = (n + 1, 0, n, 1)  # (bodies, prefix, period, repeats)
    for prefix in range(n):
        if prefix + 1 >= best[0]:
            break
        for period in range(1, n - prefix + 1):
            if prefix + period >= best[0]:
                break
            repeats = (n - prefix) // period
            body = kinds[prefix : prefix + period]
            if all(kinds[prefix + i] == body[i % period] for i in range(period * repeats)):
                bodies = prefix + period + (n - prefix - period * repeats)
                if bodies < best[0]:
                    best = (bodies, prefix, period, repeats)
    _, prefix, period, repeats = best
    rest = prefix + period * repeats
    runs = [LayerRun(0, prefix, 1)] if prefix else []
    runs.append(LayerRun(prefix, period, repeats))
    if rest < n:
        runs.append(LayerRun(rest, n - rest, 1))
    return tuple(runs)
