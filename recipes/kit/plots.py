"""The curves of a run as one figure: a grid of small panels, one per metric."""

import math
from pathlib import Path


def plot(records: list[dict], path: Path, title: str) -> None:
    """Plot every metric of `records` against the step into `path` (PNG).

    Panels sit in a grid of at most four columns. Metrics evaluated at step 0 (before
    training) show that starting value as a dashed line, so the change is visible.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for r in records for k in r if k != "step"})
    if not keys:
        return
    columns = min(4, len(keys))
    rows = math.ceil(len(keys) / columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(3.4 * columns, 2.6 * rows), squeeze=False, sharex=True
    )
    for ax, key in zip(axes.flat, keys, strict=False):
        points = [(r["step"], r[key]) for r in records if key in r]
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, marker="." if len(points) < 40 else None, linewidth=1.2)
        if steps[0] == 0:
            ax.axhline(values[0], color="grey", linestyle="--", linewidth=0.8)
            ax.annotate(
                f"start {values[0]:.3g}", (0, values[0]), fontsize=7, color="grey",
                xytext=(2, 3), textcoords="offset points",
            )  # fmt: skip
        ax.set_title(key, fontsize=9)
        ax.tick_params(labelsize=7, labelbottom=True)  # steps under every panel
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(keys) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("step", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
