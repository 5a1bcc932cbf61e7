r"""A GRPO update with shared prompts against the concatenated forward pass, side by side.

    python benchmarks/shared_prompts.py                  # Qwen3-shaped, 4 layers, H 256; G 8, 16
    python benchmarks/shared_prompts.py --size smoke     # seconds; what the tests run
    python benchmarks/shared_prompts.py --json-out result.json

One GRPO update: `rollout.completion_logps` of `B * G` completions after their `B` prompts,
the clipped policy-gradient loss (`losses.policy_gradient_loss` on random advantages,
`losses.aggregate(mode="seq_mean_token_mean")`), its gradient with respect to every
parameter and an AdamW step, jitted as one function, in two variants:

- ``shared``: `share_prompts=True` (the default): each prompt runs once into a KV cache and
  its G completions attend to it; the layers see $B P + B G N$ tokens.
- ``concat``: `share_prompts=False`: one forward pass over each prompt and completion
  concatenated, as TRL and Tunix score; the layers see $B G (P + N)$ tokens.

Prompts are left-padded to $P$ (real lengths drawn in $[P/2, P]$) and completions stop at
lengths drawn in $[N/4, N]$. Before timing, both variants' log-probs and gradients are
compared at the same parameters (max $|\Delta \log p|$; the gradients' largest difference
relative to their largest entry). Each layer layout (`scan_layers` True: ``stacked``; False:
``unrolled``) runs in its own worker subprocess, which compiles both variants at every group
size (compile seconds and `memory_analysis()` bytes reported) and then times them step by
step in turn, `--repeats` steps each after a warm-up, so that the shared machine's load
falls on both alike. Reported: the median seconds per update and the ratio
concat / shared. The script prints a table and one JSON line.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from _measure import step_memory, worker_result

VARIANTS = ("shared", "concat")
LAYOUTS = {"stacked": True, "unrolled": False}


class Size(NamedTuple):
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    width: int
    vocab: int
    prompts: int
    prompt_len: int
    new_tokens: int
    groups: tuple[int, ...]
    layouts: tuple[str, ...]


SIZES = {
    "default": Size(
        layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, width=768, vocab=1024,
        prompts=2, prompt_len=64, new_tokens=64, groups=(8, 16), layouts=("stacked", "unrolled"),
    ),
    "smoke": Size(
        layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, width=64, vocab=64,
        prompts=1, prompt_len=8, new_tokens=8, groups=(4,), layouts=("stacked",),
    ),
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--size", choices=sorted(SIZES), default="default", help="model and lengths")
    p.add_argument("--repeats", type=int, default=10, help="timed updates per variant")
    p.add_argument(
        "--scan-unroll", type=int, default=1,
        help="the stacked layers' DecoderConfig.scan_unroll (layers a step of the scan's loop)",
    )  # fmt: skip
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    p.add_argument("--worker", choices=LAYOUTS, help=argparse.SUPPRESS)
    return p


def worker(layout: str, size: Size, repeats: int, out: Path, scan_unroll: int = 1) -> None:
    """Both variants at every group size, for one layer layout: errors, compile seconds,
    memory and timed updates, written as JSON to `out`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from tunelib import losses
    from tunelib.models import Decoder, DecoderConfig
    from tunelib.rollout import completion_logps

    config = DecoderConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.width,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads, head_dim=size.head_dim, use_qk_norm=True,
        tie_word_embeddings=True, scan_layers=LAYOUTS[layout], scan_unroll=scan_unroll,
    )  # fmt: skip
    graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
    optimizer = optax.adamw(1e-5)

    def batch_of(group: int) -> dict:
        rng = np.random.default_rng(group)
        b, p, n = size.prompts, size.prompt_len, size.new_tokens
        real = rng.integers(p // 2, p + 1, b)
        stops = rng.integers(max(n // 4, 1), n + 1, b * group)
        return {
            "prompts": rng.integers(0, size.vocab, (b, p), dtype=np.int32),
            "prompt_where": np.arange(p)[None] >= (p - real)[:, None],
            "tokens": rng.integers(0, size.vocab, (b * group, n), dtype=np.int32),
            "where": np.arange(n)[None] < stops[:, None],
            "advantages": rng.standard_normal(b * group).astype(np.float32),
            "old": np.full((b * group, n), -np.log(size.vocab), np.float32),
        }

    def loss(params, batch, share):
        token_logps = completion_logps(
            graphdef, params, batch["prompts"], batch["prompt_where"], batch["tokens"],
            batch["where"], share_prompts=share,
        )  # fmt: skip
        per_token = losses.policy_gradient_loss(
            token_logps, batch["old"], batch["advantages"], epsilon_low=0.2, epsilon_high=0.2,
            where=batch["where"],
        )  # fmt: skip
        total = losses.aggregate(per_token, mode="seq_mean_token_mean", where=batch["where"])
        return total.total / total.count, token_logps

    def update(params, opt_state, batch, share):
        (value, _), grads = jax.value_and_grad(loss, has_aux=True)(params, batch, share)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    check = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=2)
    records = {}
    for group in size.groups:
        batch = batch_of(group)
        (_, shared_logps), shared_grads = check(params, batch, True)
        (_, concat_logps), concat_grads = check(params, batch, False)
        grads = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
                 for g in (shared_grads, concat_grads)]  # fmt: skip
        record = {
            "rows": size.prompts * group,
            "max_abs_logp_diff": float(np.abs(shared_logps - concat_logps).max()),
            "grad_rel_diff": float(np.abs(grads[0] - grads[1]).max() / np.abs(grads[1]).max()),
        }
        steps, states = {}, {}
        for variant in VARIANTS:
            step = jax.jit(update, static_argnums=3, donate_argnums=(0, 1))
            args = (jax.tree.map(jnp.array, params), optimizer.init(params), batch)  # copies
            start = time.perf_counter()
            compiled = step.lower(*args, variant == "shared").compile()
            record[f"{variant}_compile_s"] = time.perf_counter() - start
            record[f"{variant}_total_bytes"] = step_memory(compiled)["total_bytes"]
            steps[variant], states[variant] = compiled, compiled(*args)  # the warm-up
        seconds = {variant: [] for variant in VARIANTS}
        for _ in range(repeats):
            for variant in VARIANTS:
                start = time.perf_counter()
                states[variant] = steps[variant](*states[variant][:2], batch)
                states[variant][2].block_until_ready()
                seconds[variant].append(time.perf_counter() - start)
        for variant in VARIANTS:
            record[f"{variant}_median_s"] = statistics.median(seconds[variant])
            record[f"{variant}_runs_s"] = seconds[variant]
        record["speedup"] = record["concat_median_s"] / record["shared_median_s"]
        records[str(group)] = record
    out.write_text(json.dumps({"backend": jax.default_backend(), "groups": records}))


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    size = SIZES[args.size]
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.scan_unroll < 1:
        parser.error(f"--scan-unroll must be >= 1, got {args.scan_unroll}")
    if args.worker:
        worker(args.worker, size, args.repeats, args.json_out, args.scan_unroll)
        return
    layouts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in size.layouts:
            out = Path(tmp) / f"{layout}.json"
            command = [sys.executable, __file__, "--worker", layout, "--size", args.size,
                       "--repeats", str(args.repeats), "--scan-unroll", str(args.scan_unroll),
                       "--json-out", str(out)]  # fmt: skip
            layouts[layout] = worker_result(command, out, label=layout)
    failed = {k: v["failed"] for k, v in layouts.items() if "failed" in v}
    if failed:
        print(json.dumps(failed, indent=1), file=sys.stderr)
        raise SystemExit(1)
    header = (f"{'layers':<9} {'G':>3} {'rows':>5} {'shared s':>9} {'concat s':>9} "
              f"{'speedup':>8} {'compile s, shared/concat':>25} {'max|dlogp|':>11} "
              f"{'grad rel':>9}")  # fmt: skip
    print(header)
    for layout, result in layouts.items():
        for group, r in result["groups"].items():
            compile_s = f"{r['shared_compile_s']:.1f} / {r['concat_compile_s']:.1f}"
            print(
                f"{layout:<9} {group:>3} {r['rows']:>5} {r['shared_median_s']:9.4f} "
                f"{r['concat_median_s']:9.4f} {r['speedup']:7.2f}x {compile_s:>25} "
                f"{r['max_abs_logp_diff']:11.2e} {r['grad_rel_diff']:9.2e}"
            )
    result = {
        "size": args.size,
        **size._asdict(),
        "repeats": args.repeats,
        "scan_unroll": args.scan_unroll,
        "backend": layouts[size.layouts[0]]["backend"],
        "layouts": {k: v["groups"] for k, v in layouts.items()},
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
