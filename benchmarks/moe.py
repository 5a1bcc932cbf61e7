r"""Side by side: a mixture-of-experts layer's forward and backward pass, four ways.

    python benchmarks/moe.py                  # 4,096 tokens, H 256, 8 experts of width 512, top-2
    python benchmarks/moe.py --size smoke --rounds 1    # seconds; what the tests run

Every variant computes $L = \sum_{n} \langle y_n, c_n \rangle$ for a fixed random $c$ and its
gradients with respect to the tokens $x$ `[N, H]` and every weight, in float32:

- ``grouped``: `tunelib.models.MoE` as the decoder runs it: softmax top-k routing, the
  (token, expert) pairs sorted by expert, one grouped product per projection
  (`tunelib.models.grouped_matmul`, "auto": the blocked lowering on CPU, `ragged_dot` on
  GPU and TPU);
- ``blocked``: the same layer with the blocked lowering forced (tokens in blocks of one
  expert each, a batched product over the blocks); refused on a TPU, and listed there as
  skipped (`grouped_matmul`'s docstring says why);
- ``ragged_dot``: the same layer with `jax.lax.ragged_dot` forced (on CPU JAX lowers it by
  expanding the rows over every expert);
- ``naive``: the one-hot dispatch: every token through every expert, the outputs weighted by
  the routing weights (zero for experts not chosen): $E/k$ times the expert FLOPs;
- ``dense``: a dense SwiGLU MLP with the same active parameters (width $k F$), no router:
  the floor a sparse layer's compute is judged against.

The parent process orchestrates; each variant runs in its own subprocess so that buffers and
peak RSS never mix. First every sparse variant's output and gradients are checked against the
naive one (they compute the same function); then `memory_analysis()` of the compiled step
(temporary bytes), the worker's peak RSS and `--repeats` timed runs after a warm-up. There are
`--rounds` rounds, each running every variant's worker in turn, so that the machine's load
drifts alike for all; a variant's time is the median over all its runs. The script prints a
table and ends with one JSON line with `time_ratio_vs_naive`, `time_ratio_vs_dense` and
`memory_ratio_vs_naive` for ``grouped``.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Size(NamedTuple):
    tokens: int
    hidden: int
    width: int  # each expert's MLP width F
    experts: int
    top_k: int


SIZES = {
    "smoke": Size(tokens=64, hidden=16, width=32, experts=4, top_k=2),
    "cpu": Size(tokens=4096, hidden=256, width=512, experts=8, top_k=2),
}
VARIANTS = ("grouped", "blocked", "ragged_dot", "naive", "dense")
SPARSE = ("grouped", "blocked", "ragged_dot")  # the same layer, lowered three ways
TOLERANCE = 1e-4  # relative to the naive path's largest value, per output


def inputs(size: Size) -> dict:
    rng = np.random.default_rng(0)
    n, h, f, e = size.tokens, size.hidden, size.width, size.experts

    def normal(*shape, scale=1.0):
        return (rng.normal(size=shape) * scale).astype(np.float32)

    return {
        "x": normal(n, h),
        "cotangent": normal(n, h),
        "router": normal(h, e, scale=h**-0.5),
        "gate": normal(e, h, f, scale=h**-0.5),
        "up": normal(e, h, f, scale=h**-0.5),
        "down": normal(e, f, h, scale=f**-0.5),
        # The dense MLP of the same active parameters: the k chosen experts side by side.
        "dense_gate": normal(h, size.top_k * f, scale=h**-0.5),
        "dense_up": normal(h, size.top_k * f, scale=h**-0.5),
        "dense_down": normal(size.top_k * f, h, scale=f**-0.5),
    }


def layer_fn(variant: str, size: Size):
    """`f(weights, x) -> y` of `variant`."""
    from flax import nnx

    from tunelib.models import DecoderConfig, MoE, route

    if variant in SPARSE:
        config = DecoderConfig(
            vocab_size=8, hidden_size=size.hidden, intermediate_size=size.width,
            num_hidden_layers=1, num_attention_heads=1, head_dim=size.hidden,
            num_experts=size.experts, num_experts_per_tok=size.top_k,
        )  # fmt: skip
        implementation = "auto" if variant == "grouped" else variant
        graphdef, _ = nnx.split(
            nnx.eval_shape(lambda: MoE(config, implementation=implementation, rngs=nnx.Rngs(0)))
        )

        def grouped(w, x):
            params = {
                "gate": {"kernel": w["router"]},
                "experts": {
                    "gate_proj": {"kernel": w["gate"]},
                    "up_proj": {"kernel": w["up"]},
                    "down_proj": {"kernel": w["down"]},
                },
            }
            return nnx.merge(graphdef, params)(x[None])[0][0]

        return grouped
    if variant == "naive":

        def naive(w, x):
            weights, chosen = route(x @ w["router"], top_k=size.top_k)
            gates = jnp.sum(jax.nn.one_hot(chosen, size.experts) * weights[..., None], axis=-2)
            hidden = jax.nn.silu(jnp.einsum("nh,ehf->nef", x, w["gate"]))
            hidden = hidden * jnp.einsum("nh,ehf->nef", x, w["up"])
            return jnp.einsum("nef,efh,ne->nh", hidden, w["down"], gates)

        return naive

    def dense(w, x):
        return (jax.nn.silu(x @ w["dense_gate"]) * (x @ w["dense_up"])) @ w["dense_down"]

    return dense


# Variants a backend refuses, and why (the worker says so instead of running).
NOT_ON = {("blocked", "tpu"): "refused on TPU (the MoE layer's input gradient was wrong on a v5e)"}


def worker(variant: str, size: Size, repeats: int, out: Path) -> None:
    if (variant, jax.default_backend()) in NOT_ON:
        out.write_text(
            json.dumps({"variant": variant, "skipped": NOT_ON[variant, jax.default_backend()]})
        )
        return
    data = inputs(size)
    x, cotangent = jnp.asarray(data.pop("x")), jnp.asarray(data.pop("cotangent"))
    weights = {k: jnp.asarray(v) for k, v in data.items()}
    fn = layer_fn(variant, size)

    def loss(w, x):
        return jnp.sum(fn(w, x) * cotangent)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    compiled = step.lower(weights, x).compile()
    memory = compiled.memory_analysis()
    value, (dw, dx) = jax.block_until_ready(compiled(weights, x))
    names = ("dense_gate", "dense_up", "dense_down") if variant == "dense" else (
        "router", "gate", "up", "down")  # fmt: skip
    np.savez(
        out.with_suffix(".npz"),
        y=np.asarray(jax.jit(fn)(weights, x)),
        dx=np.asarray(dx),
        **{f"d_{k}": np.asarray(dw[k]) for k in names},
    )
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(weights, x))
        runs.append(1000 * (time.perf_counter() - start))
    record = {
        "variant": variant,
        "loss": float(value),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "runs_ms": runs,
    }
    out.write_text(json.dumps(record))


def run_worker(variant: str, size_name: str, repeats: int, folder: Path) -> dict:
    out = folder / f"{variant}.json"
    command = [sys.executable, __file__, "--worker", variant, "--size", size_name]
    command += ["--repeats", str(repeats), "--json-out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def check(folder: Path, variants: list[str]) -> dict[str, dict[str, float]]:
    """Each sparse variant's largest error against the naive path, relative to its scale, per
    output (`y`, `dx` and each weight's gradient)."""
    naive = np.load(folder / "naive.npz")
    errors = {}
    for variant in variants:
        ours = np.load(folder / f"{variant}.npz")
        errors[variant] = {
            k: float(np.abs(ours[k] - naive[k]).max() / max(np.abs(naive[k]).max(), 1e-30))
            for k in naive.files
        }
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per worker")
    parser.add_argument("--rounds", type=int, default=3, help="workers per variant, interleaved")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = SIZES[args.size]
    if args.worker:
        worker(args.worker, size, args.repeats, args.json_out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        records = {v: run_worker(v, args.size, args.repeats, folder) for v in VARIANTS}
        skipped = {v: r.pop("skipped") for v, r in list(records.items()) if "skipped" in r}
        for variant in skipped:
            del records[variant]
        by_output = check(folder, [v for v in SPARSE if v in records])
        errors = {variant: max(e.values()) for variant, e in by_output.items()}
        correct = all(e <= TOLERANCE for e in errors.values())
        if not correct:
            print(f"sparse variants disagree with the naive path, by output: {by_output}")
            raise SystemExit(1)
        for _ in range(args.rounds - 1):
            for variant in records:
                again = run_worker(variant, args.size, args.repeats, folder)
                records[variant]["runs_ms"] += again["runs_ms"]
                records[variant]["peak_rss_bytes"] = max(
                    records[variant]["peak_rss_bytes"], again["peak_rss_bytes"]
                )
    for record in records.values():
        record["median_ms"] = statistics.median(record["runs_ms"])
    grouped, naive, dense = records["grouped"], records["naive"], records["dense"]
    flops = 3 * 2 * size.tokens * size.top_k * size.hidden * size.width * 3  # fwd + bwd
    print(f"{'variant':<11} {'temp MB':>9} {'peak RSS MB':>12} {'median ms':>10} {'GFLOP/s':>8}")
    for variant, r in records.items():
        executed = flops * (size.experts / size.top_k if variant == "naive" else 1)
        rate = "" if variant == "ragged_dot" else f"{executed / r['median_ms'] / 1e6:8.1f}"
        print(
            f"{variant:<11} {r['temp_bytes'] / 2**20:9.2f} {r['peak_rss_bytes'] / 2**20:12.1f} "
            f"{r['median_ms']:10.2f} {rate:>8}"
        )
    result = {
        "size": args.size,
        **size._asdict(),
        "backend": jax.default_backend(),
        "repeats": args.repeats,
        "rounds": args.rounds,
        "correct": correct,
        "errors_vs_naive": errors,
        "errors_vs_naive_by_output": by_output,
        "time_ratio_vs_naive": naive["median_ms"] / grouped["median_ms"],
        "time_ratio_vs_dense": grouped["median_ms"] / dense["median_ms"],
        "memory_ratio_vs_naive": naive["temp_bytes"] / grouped["temp_bytes"],
        "variants": records,
        "skipped": skipped,
    }
    if "blocked" in records:  # which lowering "auto" should pick: above 1, ragged_dot
        blocked, ragged = records["blocked"]["median_ms"], records["ragged_dot"]["median_ms"]
        result["blocked_time_vs_ragged_dot"] = blocked / ragged
    if args.json_out:
        args.json_out.write_text(json.dumps(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
