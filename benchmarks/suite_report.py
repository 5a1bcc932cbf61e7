r"""The summary of an `accelerator_suite.sh` run: one line per part, and every result in one file.

    python benchmarks/suite_report.py STATUS PARTS_DIR OUT_DIR [--header FILE]
        [--budget S] [--seconds S]

`STATUS` is the suite's record of its parts, one line each, tab-separated: the part's name,
its exit status (`-` when it did not run), its seconds, its time limit and a note (why it
was skipped). `PARTS_DIR` holds a folder per part with the JSON files it wrote. This script
writes into `OUT_DIR`:

- `summary.txt`: a table with one line per part: its status (`ok`, `exit N`, `time limit`
  when its limit stopped it, `skipped`), its seconds and its headline figure, read from
  its JSON results;
- `results.json`: `{"suite": {"header", "budget", "seconds"}, "parts": {name: {"status",
  "exit", "seconds", "limit", "note", "headline", "results": {file name: its JSON}}}}`,
  every figure of the run in one file (a JSON-lines file is the list of its lines; a file
  that is neither is kept as text). `--header` names a file whose text (the machine, the
  versions) goes into `suite`, with the suite's `--budget` and the `--seconds` it took.

It prints the table too, and exits with status 1 when a part that ran did not end with status
0 (else 0). It imports nothing but the standard library (no JAX), so that it runs
at once after the suite's last part, whatever state the accelerator is in.
"""

import argparse
import json
import sys
from pathlib import Path

# The statuses of a part that `timeout` stopped at its limit: 124 when it ended on SIGINT,
# 137 (128 + SIGKILL) when it had to be killed.
TIMED_OUT, KILLED = 124, 137


def _ms(x) -> str:
    return "-" if x is None else f"{x:,.1f}"


def logprobs_headline(r: dict) -> str:
    """Each variant's median, the memory ratio, and what ran out of memory or failed."""
    times = []
    for name, v in r["variants"].items():
        if v.get("out_of_memory"):
            times.append(f"{name} OOM")
        elif "median_ms" in v:
            times.append(f"{name} {_ms(v['median_ms'])} ms")
        else:
            times.append(f"{name} {'FAIL' if not v['passed'] else 'failed'}")
    memory = r.get("memory_ratio")
    memory = "-" if memory is None else f"{memory:.1f}x"
    return f"{r['size']} N={r['n']}: {', '.join(times)}; naive/chunked temp {memory}"


def sampler_headline(r: dict) -> str:
    steps = ", ".join(
        f"B{row['batch']} {row['decode_ms_per_step']:.2f} ms "
        f"({(row['roofline_fraction'] or 0):.0%})"
        for row in r["batches"]
    )
    return f"decode ms/step (of roofline): {steps}"


def nf4_headline(r: dict) -> str:
    """The Pallas kernel's forward speed-up over XLA per case, or why it has none; where the
    kernel was not run (a TPU), XLA's forward time per case and why."""
    correct = "correct" if r["correct"] else "NOT correct"
    skipped = [c["variants"].get("pallas", {}).get("skipped") for c in r["cases"]]
    if r["cases"] and all(skipped):
        forward = [c["variants"]["xla"].get("forward_ms") for c in r["cases"]]
        times = ", ".join(
            f"{c['n_in']}x{c['n_out']} M{c['m']} {'-' if ms is None else f'{ms:.3f}'}"
            for c, ms in zip(r["cases"], forward, strict=True)
        )
        return f"{correct}; xla forward ms: {times}; pallas {skipped[0]}"

    def speedup(case: dict) -> str:
        if "pallas_speedup_forward" in case:
            return f"{case['pallas_speedup_forward']:.2f}x"
        pallas = case["variants"].get("pallas", {})
        if "failed" in pallas:
            return "pallas failed: " + pallas["failed"].split(":")[0]
        return "not timed" if pallas.get("passed", True) else "pallas wrong"

    cases = ", ".join(f"{c['n_in']}x{c['n_out']} M{c['m']} {speedup(c)}" for c in r["cases"])
    return f"{correct}; pallas forward speed-up: {cases}"


def parity_headline(r: dict) -> str:
    return (
        f"{r['steps']} steps: trainer logp max diff {max(r['max_trainer_logp_diff']):.1e}, "
        f"grad norm rel diff {max(r['grad_norm_relative_diff']):.1e}, "
        f"tokens equal {min(r['token_agreement']):.1%}"
    )


def recipe_headline(r: dict) -> str:
    """Its seconds, the compile phase's and goodput (`time`), and the held-out accuracy."""
    t = r["time"]
    text = f"{r['recipe']} {r['seconds']} s (compile {t.get('compile', 0):.0f} s"
    text += f", goodput {t.get('goodput', 0):.0%})"
    if "accuracy_after" in r:
        text += f", accuracy {r.get('accuracy_before')} -> {r['accuracy_after']}"
    return text


def headline(results: dict) -> str:
    """The headline figures of one part's JSON results, or ''."""
    lines = []
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        kind = r.get("benchmark")
        try:
            if kind == "logprobs" and "variants" in r:
                lines.append(logprobs_headline(r))
            elif kind == "sampler_roofline":
                lines.append(sampler_headline(r))
            elif kind == "nf4_matmul":
                lines.append(nf4_headline(r))
            elif kind == "grpo_parity" and r.get("mode") == "compare":
                lines.append(parity_headline(r))
            elif "recipe" in r and "time" in r:
                lines.append(recipe_headline(r))
        except (KeyError, TypeError, ValueError) as error:
            lines.append(f"{name}: unreadable ({type(error).__name__}: {error})")
    return "; ".join(lines)


def read_results(folder: Path) -> dict:
    """The files of a part's folder in the order they were written: JSON parsed (a JSON-lines
    file: the list of its lines), anything else as text."""
    results = {}
    paths = sorted(folder.glob("*"), key=lambda p: (p.stat().st_mtime_ns, p.name))
    for path in paths if folder.is_dir() else []:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        try:
            results[path.name] = json.loads(text)
        except json.JSONDecodeError:
            try:
                results[path.name] = [json.loads(line) for line in text.splitlines() if line]
            except json.JSONDecodeError:
                results[path.name] = text
    return results


def status_of(exit_code: str, seconds: int, limit: int) -> str:
    if exit_code == "-":
        return "skipped"
    code = int(exit_code)
    if code == 0:
        return "ok"
    if code == TIMED_OUT or (code == KILLED and seconds >= limit - 1):
        return "time limit"
    return f"exit {code}"


def report(status: Path, parts: Path, out: Path, suite: dict | None = None) -> str:
    """Write `summary.txt` and `results.json` into `out`; return the summary's text."""
    rows, packed = [], {}
    for line in status.read_text().splitlines():
        if not line.strip():
            continue
        name, exit_code, seconds, limit, note = (line.split("\t") + [""] * 5)[:5]
        seconds, limit = int(seconds or 0), int(limit or 0)
        results = read_results(parts / name)
        entry = {
            "status": status_of(exit_code, seconds, limit),
            "exit": None if exit_code == "-" else int(exit_code),
            "seconds": seconds,
            "limit": limit,
            "note": note,
            "headline": headline(results) or note,
            "results": results,
        }
        packed[name] = entry
        rows.append((name, entry["status"], str(seconds), entry["headline"]))
    head = ("part", "status", "s", "headline")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    text = "\n".join(
        "  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2]), r[3]])
        for r in [head, *rows]
    )
    ran = sum(e["exit"] is not None for e in packed.values())
    ok = sum(e["status"] == "ok" for e in packed.values())
    text += f"\n{ok} of {len(rows)} parts ok, {ran} run\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text(text)
    document = {"suite": suite or {}, "parts": packed}
    (out / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("status", type=Path, help="the suite's status file (tab-separated)")
    p.add_argument("parts", type=Path, help="the folder of the parts' folders")
    p.add_argument("out", type=Path, help="where summary.txt and results.json go")
    p.add_argument("--header", type=Path, default=None, help="the run's header text")
    p.add_argument("--budget", type=int, default=None, help="the suite's budget, seconds")
    p.add_argument("--seconds", type=int, default=None, help="the seconds the suite took")
    args = p.parse_args(argv)
    suite = {
        "header": args.header.read_text() if args.header and args.header.is_file() else None,
        "budget": args.budget,
        "seconds": args.seconds,
    }
    text = report(args.status, args.parts, args.out, suite)
    print(text, end="")
    return 0 if all_ran_ok(args.out / "results.json") else 1


def all_ran_ok(results: Path) -> bool:
    """Whether every part that ran (not skipped) ended with status 0."""
    parts = json.loads(results.read_text())["parts"].values()
    return all(p["exit"] in (None, 0) for p in parts)


if __name__ == "__main__":
    sys.exit(main())
