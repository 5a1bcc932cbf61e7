r"""GRPO pushed toward entropy collapse, with and without the adaptive entropy controller.

    python benchmarks/grpo_collapse.py --out runs/collapse          # about an hour on 2 cores
    python benchmarks/grpo_collapse.py --out runs/collapse --summarize-only   # the table again

One SFT start (`recipes/sft.py --steps --sft-steps`), then for each seed two GRPO runs from it
with the same settings, chosen to push the policy toward collapse: full fine-tuning at a high
learning rate (`--learning-rate`) and no KL penalty. The `controlled` arm adds the adaptive
entropy controller (`--target-entropy`, `--entropy-step`, `--max-entropy-weight`: an entropy
bonus whose weight rises while the entropy is below the target, Skywork-OR1's rule). Both
evaluate every `--eval-every` steps on the held-out problems with 8 samples each: greedy
accuracy, pass@1 and pass@8 of the samples, and their entropy (`kit.evaluate.samples`), and
print the collapse guard's warning lines (`kit.watch`), which are counted here.

The script prints a table (per arm and seed: the metrics at the first and last evaluation,
the lowest entropy, the guard's warnings), writes `collapse.png` (pass@1, pass@8 and entropy
against the step, one line per run) in `--out`, and ends with one JSON line. Runs that exist
are not run again (delete their folder to redo one).
"""

import argparse
import json
import sys
from pathlib import Path

from _recipe_runs import run_recipe

ARMS = ("pushed", "controlled")
SHOWN = ("accuracy", "pass_at_1", "pass_at_k", "sample_entropy")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("runs/collapse"))
    p.add_argument("--seeds", default="0,1,2", help="comma-separated GRPO seeds")
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--steps", type=int, default=50, help="GRPO steps of each run")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--target-entropy", type=float, default=0.75)
    p.add_argument("--entropy-step", type=float, default=2e-3)
    p.add_argument("--max-entropy-weight", type=float, default=0.05)
    p.add_argument("--extra", default="", help="more flags for every recipe run (quoted)")
    p.add_argument(
        "--summarize-only", action="store_true", help="read the runs in --out, run nothing"
    )
    return p


def run_all(args, seeds: list[int]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["--no-progress", *args.extra.split()]
    sft = args.out / "sft"
    if not (sft / "result.json").exists():
        run_recipe("sft", ["--steps", str(args.sft_steps), "--out", str(sft), *common],
            args.out / "sft.log")  # fmt: skip
    pushed = [
        "--model", str(sft / "model"), "--steps", str(args.steps),
        "--eval-every", str(args.eval_every), "--checkpoint-every", str(args.steps),
        "--learning-rate", str(args.learning_rate), "--kl-coef", "0", *common,
    ]  # fmt: skip
    arms = {
        "pushed": pushed,
        "controlled": [
            *pushed, "--target-entropy", str(args.target_entropy),
            "--entropy-step", str(args.entropy_step),
            "--max-entropy-weight", str(args.max_entropy_weight),
        ],
    }  # fmt: skip
    for seed in seeds:
        for arm, flags in arms.items():
            folder = args.out / f"{arm}-seed{seed}"
            if not (folder / "result.json").exists():
                run_recipe("grpo", [*flags, "--seed", str(seed), "--out", str(folder)],
                    args.out / f"{arm}-seed{seed}.log")  # fmt: skip


def summarize(out: Path, seeds: list[int]) -> dict:
    """The table and the plot of the runs in `out`; returns the JSON summary."""
    rows = []
    for arm in ARMS:
        for seed in seeds:
            folder = out / f"{arm}-seed{seed}"
            metrics = folder / "metrics.jsonl"
            if not metrics.exists():
                continue
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
            evaluated = [r for r in records if "pass_at_k" in r]
            log = out / f"{arm}-seed{seed}.log"
            text = log.read_text() if log.exists() else ""
            rows.append({
                "arm": arm, "seed": seed, "steps": [r["step"] for r in evaluated],
                **{k: [r[k] for r in evaluated] for k in SHOWN},
                "entropy_weight": [r.get("entropy_weight", 0.0) for r in records if "step" in r],
                "warnings": text.count("entropy collapse?"),
            })  # fmt: skip
    header = (f"{'arm':>10} {'seed':>4} {'greedy acc':>15} {'pass@1':>15} {'pass@8':>15} "
              f"{'entropy':>15} {'min H':>6} {'warned':>6}")  # fmt: skip
    print(header)
    for row in rows:
        cells = [f"{row[k][0]:.3f} -> {row[k][-1]:.3f}" for k in SHOWN]
        print(f"{row['arm']:>10} {row['seed']:>4} " + " ".join(f"{c:>15}" for c in cells)
              + f" {min(row['sample_entropy']):>6.3f} {row['warnings']:>6}")  # fmt: skip
    if rows:
        _plot(rows, out / "collapse.png")
    return {"benchmark": "grpo_collapse", "runs": rows}


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    colors = {"pushed": "tab:red", "controlled": "tab:blue"}
    for ax, key, title in zip(axes, SHOWN[1:], ("pass@1 (8 samples)", "pass@8", "entropy"),
                              strict=True):  # fmt: skip
        for row in rows:
            label = row["arm"] if row["seed"] == rows[0]["seed"] else None
            ax.plot(row["steps"], row[key], color=colors[row["arm"]], alpha=0.8, label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.summarize_only:
        run_all(args, seeds)
    summary = summarize(args.out, seeds)
    if not summary["runs"]:
        parser.error(f"no runs in {args.out}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
