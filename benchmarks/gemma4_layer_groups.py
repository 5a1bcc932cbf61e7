r"""Compile time of a Gemma 4 whose layers are scanned by groups against the unrolled layers.

    python benchmarks/gemma4_layer_groups.py                 # 26 layers, tiny widths
    python benchmarks/gemma4_layer_groups.py --layers 12 --repeats 1   # seconds; the tests
    python benchmarks/gemma4_layer_groups.py --json-out result.json

A Gemma 4 of `--layers` layers in its real pattern (five sliding layers, window 64, with
head width 32 and 2 key/value heads, then one full layer with head width 64 and 1 key/value
head that is also the value; the last layer full, as Hugging Face's config makes it) on tiny
widths (hidden 64, MLP 128, vocabulary 256, float32): at 26 layers, four patterns of six and
a sliding and a full layer left over. The program compiled is the gradient with respect to
every parameter of the summed log-probs of `rollout.completion_logps` (4 prompts of 32
tokens, completions of 32; the forward and backward passes a trainer compiles), in two
layouts of the same weights:

- ``grouped``: `scan_layers=True`: one stack per position of the pattern, one scan over its
  repeats, and the layers left over unrolled (`DecoderConfig.layer_runs`): 8 layer bodies at
  26 layers.
- ``unrolled``: `scan_layers=False`: every layer's body in the program.

Each compilation runs in a fresh worker subprocess (no compilation cache, nothing traced
before), `--repeats` times per layout, the layouts alternating; reported are the median
wall seconds of `jax.jit(...).lower(...)` and of `.compile()`, their sum, the compiled
program's size (characters of its HLO text) and the ratio unrolled / grouped, with the
machine's CPUs and load average (compile times on a shared machine vary). Before the
table, the two layouts' log-probs on the same weights must agree to 1e-4 (exit status 1
otherwise). The script prints a table and ends with one JSON line (`--json-out` writes it
to a file too).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _measure import print_result, ratio, worker_result

LAYOUTS = {"grouped": True, "unrolled": False}
PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 32, 32


def gemma4_config(layers: int) -> dict:
    """Gemma 4's layers (sliding every layer but each sixth and the last) on tiny widths."""
    full = [(i + 1) % 6 == 0 or i == layers - 1 for i in range(layers)]
    return dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=64,
        layer_types=["full_attention" if f else "sliding_attention" for f in full],
        rope_theta=1e6, rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "proportional", "factor": 1.0, "partial_rotary_factor": 0.25},
        query_pre_attn_scalar=1.0, use_qk_norm=True, value_norm=True, sandwich_norms=True,
        scale_embeddings=True, layer_scalars=True, tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh", final_logit_softcapping=30.0,
    )  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--layers", type=int, default=26, help="decoder layers (at least 2)")
    p.add_argument("--repeats", type=int, default=3, help="compilations per layout")
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    p.add_argument("--worker", choices=LAYOUTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.layers < 2:
        p.error(f"--layers must be >= 2, got {args.layers}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def worker(layout: str, layers: int, out: Path) -> None:
    """Lower and compile the gradient in one layout; write the seconds, the program's size,
    the layer bodies and the log-probs (to compare the layouts) as JSON to `out`."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tunelib.models import Decoder, DecoderConfig
    from tunelib.rollout import completion_logps

    # Both layouts hold the unrolled model's weights: each stack is its layers stacked.
    unrolled = DecoderConfig(**gemma4_config(layers))
    params = nnx.to_pure_dict(nnx.state(Decoder(unrolled, rngs=nnx.Rngs(0)), nnx.Param))
    config = DecoderConfig(**gemma4_config(layers), scan_layers=LAYOUTS[layout])
    if config.scan_layers:
        stacks = [
            jax.tree.map(lambda *xs: jnp.stack(xs), *[params["layers"][i] for i in members])
            for members in config.layer_stacks
        ]
        params["layers"] = stacks[0] if len(stacks) == 1 else dict(enumerate(stacks))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, (PROMPTS, PROMPT_LEN), dtype=np.int32)
    tokens = rng.integers(0, config.vocab_size, (PROMPTS, NEW_TOKENS), dtype=np.int32)
    prompt_where = np.ones(prompts.shape, bool)
    where = np.arange(NEW_TOKENS)[None] < rng.integers(NEW_TOKENS // 2, NEW_TOKENS + 1)

    def loss(params):
        logps = completion_logps(graphdef, params, prompts, prompt_where, tokens,
                                 np.broadcast_to(where, tokens.shape))  # fmt: skip
        return logps.sum(), logps

    start = time.perf_counter()
    lowered = jax.jit(jax.grad(loss, has_aux=True)).lower(params)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    _, logps = compiled(params)
    result = {
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "layer_bodies": len(config.layer_stacks) if config.scan_layers else layers,
        "lower_s": lowered_at - start,
        "compile_s": compiled_at - lowered_at,
        "total_s": compiled_at - start,
        "hlo_chars": len(compiled.as_text()),
        "logps": np.asarray(logps).tolist(),
    }
    out.write_text(json.dumps(result))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.layers, args.json_out)
        return 0
    runs = {layout: [] for layout in LAYOUTS}
    load = os.getloadavg()[0]  # a shared machine's load falls on both layouts alike
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for layout in list(LAYOUTS)[:: -1 if repeat % 2 else 1]:
                out = Path(tmp) / f"{layout}-{repeat}.json"
                command = [sys.executable, __file__, "--worker", layout,
                           "--layers", str(args.layers), "--json-out", str(out)]  # fmt: skip
                runs[layout].append(worker_result(command, out, label=f"{layout} {repeat}"))
    failed = {k: r["failed"] for k, rs in runs.items() for r in rs if "failed" in r}
    if failed:
        print(json.dumps(failed, indent=1), file=sys.stderr)
        return 1
    import numpy as np

    logps = {k: np.asarray(rs[0]["logps"]) for k, rs in runs.items()}
    difference = float(np.abs(logps["grouped"] - logps["unrolled"]).max())
    if difference > 1e-4:
        print(f"the layouts' log-probs differ by {difference:.2e}", file=sys.stderr)
        return 1
    rows = {}
    for layout, rs in runs.items():
        rows[layout] = {
            "layer_bodies": rs[0]["layer_bodies"],
            **{k: statistics.median(r[k] for r in rs) for k in ("lower_s", "compile_s", "total_s")},
            "hlo_chars": rs[0]["hlo_chars"],
            "runs_total_s": [r["total_s"] for r in rs],
        }
    keys = ("lower_s", "compile_s", "total_s", "hlo_chars")
    over = {k: ratio(rows["unrolled"][k], rows["grouped"][k]) for k in keys}
    backend, version = runs["grouped"][0]["backend"], runs["grouped"][0]["jax"]
    print(f"Gemma 4, {args.layers} layers, tiny widths; gradient of completion_logps "
          f"({PROMPTS} x ({PROMPT_LEN} + {NEW_TOKENS}) tokens); {backend}, jax {version}; "
          f"median of {args.repeats}")  # fmt: skip
    print("| layout | layer bodies | lower s | compile s | total s | HLO chars |")
    print("|---|---:|---:|---:|---:|---:|")
    for layout, row in rows.items():
        seconds = " | ".join(f"{row[k]:.2f}" for k in ("lower_s", "compile_s", "total_s"))
        print(f"| {layout} | {row['layer_bodies']} | {seconds} | {row['hlo_chars']:,} |")
    print(f"unrolled / grouped: lower {over['lower_s']:.2f}x, compile {over['compile_s']:.2f}x, "
          f"total {over['total_s']:.2f}x, program {over['hlo_chars']:.2f}x; log-probs within "
          f"{difference:.1e}; load average {load:.1f} at the start")  # fmt: skip
    result = {
        "benchmark": "gemma4_layer_groups", "layers": args.layers, "repeats": args.repeats,
        "backend": backend, "jax": version, "cpus": os.cpu_count(), "load_average": load,
        "max_logp_difference": difference,
        "layouts": rows, "unrolled_over_grouped": over,
    }  # fmt: skip
    print_result(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
