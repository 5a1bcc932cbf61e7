r"""tunelib's sampler against Tunix's `Sampler` and transformers' `generate`, side by side on CPU.

    python benchmarks/sampler_anchors.py --anchors-python /tmp/anchors/bin/python
    python benchmarks/sampler_anchors.py --size smoke            # tunelib only, seconds
    python benchmarks/sampler_anchors.py --anchors-python /tmp/anchors/bin/python \
        --json-out result.json

The anchors live in their own environment, outside tunelib's, since Tunix pins its own
jax and flax:

    python3 -m venv /tmp/anchors
    /tmp/anchors/bin/pip install google-tunix==0.1.7 transformers torch   # CPU torch

Without `--anchors-python` (or when that interpreter cannot import `tunix`, `transformers`
and `torch`) the anchor columns are left out with one line saying why, and tunelib is
measured alone.

The model is a Qwen3-style decoder (at the default size: 4 layers, hidden 256, 8 query and 4
key/value heads of width 32, QK-norm, SwiGLU MLP 768, vocabulary 1,024, untied head,
float32), randomly initialised by tunelib (seed 0, its default `initializer_range` 0.02) and
written once as a Hugging Face Qwen3 checkpoint (`save_hf_checkpoint`, safetensors) that
every library loads: tunelib with `load_hf_checkpoint`, its layers unrolled
(`scan_layers=False`) as Tunix's and transformers' models run theirs (`--scan-layers` stacks
them under one `lax.scan`, as the recipes load a model), transformers with
`Qwen3ForCausalLM.from_pretrained`, Tunix with
`tunix.models.qwen3.params.create_model_from_safe_tensors`. The prompts are `P` random ids
(`--prompt`, 16) per row, none padded; each call generates `N` (`--new-tokens`, 256) tokens
a row with no stop token, so tokens/s are `B * N / seconds` of the whole call, prompt array
in, completion ids on the host out:

- tunelib: `tunelib.rollout.sample` with `SamplingConfig(max_new_tokens=N, temperature=0)`
  (greedy) or `temperature=1.0, top_p=0.9`;
- Tunix: `Sampler(model, tokenizer, CacheConfig(cache_size=P + N, ...))` called with the
  prompts as strings of ids (a tokenizer that maps "5 17 3" to `[5, 17, 3]`, no BOS, its pad
  id outside the vocabulary so that no generated id is taken for padding), `max_prompt_length=P`,
  `max_generation_steps=N`, `eos_tokens=[-1]` (never drawn), `temperature=0.0` or
  `temperature=1.0, top_p=0.9`;
- transformers: `model.generate(ids, attention_mask, max_new_tokens=N, min_new_tokens=N,
  eos_token_id=None)` with `do_sample=False`, or `do_sample=True, top_p=0.9, top_k=0,
  temperature=1.0`, its defaults otherwise (dynamic cache, eager PyTorch, its default
  thread count).

Each library runs in its own process (`--worker NAME`, driven over its standard input and
output), so the three never share a thread pool or an allocator. In order:

1. Correctness, before anything is timed: the logits of one uncached forward pass over the
   prompts of the largest batch must agree between every pair of libraries within
   `--logits-tol` (1e-6, absolute), and the greedy tokens of every batch size must be
   identical across the libraries; otherwise the script exits with status 1. These first
   calls also compile and warm every library up.
2. `--rounds` interleaved rounds (6): each round times every (mode, batch) case once in every
   library, the libraries' order rotated from round to round, so that a slow spell on this
   shared machine hits all of them. Each case's figure is the median of its rounds.
3. tunelib's time per decode step, `(t_N - t_1) / (N - 1)` from calls of `N` and of 1 new
   token in the same rounds, against the floor set by matmul throughput: the time of the
   step's weight matmuls alone (every layer's q, k, v, o, gate, up and down projections and
   the head, at `[B, H]` rows), chained in a jitted loop of `N` steps in the same process.

The script prints a table and ends with one JSON line: `case`, per (mode, batch) the
tokens/s of each library, tunelib's ratio to each anchor, tunelib's step and floor times, the
logits' largest differences, whether the tokens agree, the libraries' versions, the load
average before and after, and `meets_target`: tunelib at least `TARGET` (1.1) times every
anchor in every case (null without the anchors). Targets are reported, never asserted.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _anchors import (
    SEED,
    SIZES,
    IdTokenizer,
    interpreters,
    load_average,
    reply,
    started,
    tunix_qwen3,
    tunix_version,
    write_checkpoint,
)

from _measure import print_result

LIBRARIES = ("tunelib", "tunix", "hf")
MODES = ("greedy", "top_p")
TOP_P = 0.9
TARGET = 1.1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--size", choices=tuple(SIZES), default="default", help="model size")
    p.add_argument("--batches", type=batches_arg, default=None, help="default 1,8,32 (smoke 1,2)")
    p.add_argument("--prompt", type=int, default=16, help="P, prompt ids per row")
    p.add_argument("--new-tokens", type=int, default=None, help="N, default 256 (smoke 8)")
    p.add_argument("--rounds", type=int, default=6, help="timed interleaved rounds")
    p.add_argument("--modes", type=modes_arg, default=MODES, help="greedy,top_p")
    p.add_argument(
        "--anchors-python",
        type=Path,
        default=None,
        help="the interpreter of an environment with google-tunix, transformers and torch",
    )
    p.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="load tunelib's decoder with its layers under one lax.scan (default: unrolled)",
    )
    p.add_argument("--logits-tol", type=float, default=1e-6, help="largest |logit difference|")
    p.add_argument("--json-out", type=Path, default=None, help="write the result JSON here too")
    p.add_argument("--worker", choices=LIBRARIES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def batches_arg(text: str) -> tuple[int, ...]:
    try:
        batches = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32, got {text!r}") from None
    if any(b < 1 for b in batches) or len(set(batches)) != len(batches):
        raise argparse.ArgumentTypeError(f"expected distinct batch sizes >= 1, got {text!r}")
    return batches


def modes_arg(text: str) -> tuple[str, ...]:
    modes = tuple(text.split(","))
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"expected modes from {','.join(MODES)}, got {text!r}")
    return modes


# ----------------------------------------------------------------------------- the workers


class TunelibWorker:
    def __init__(self, checkpoint: Path, scan_layers: bool):
        import jax

        from tunelib.formats import load_hf_checkpoint

        loaded = load_hf_checkpoint(checkpoint, scan_layers=scan_layers)
        self.graphdef, self.params, self.config = loaded.graphdef, loaded.params, loaded.config
        self.jax = jax
        self.versions = {"jax": jax.__version__, "jaxlib": jax.lib.__version__}

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        from flax import nnx

        model = nnx.merge(self.graphdef, self.params)
        return np.asarray(model.unembed(model(tokens)))

    def generate(self, tokens: np.ndarray, mode: str, new: int, seed: int) -> np.ndarray:
        import jax.numpy as jnp

        from tunelib.rollout import SamplingConfig, sample

        kwargs = {"temperature": 0.0} if mode == "greedy" else {"temperature": 1.0, "top_p": TOP_P}
        config = SamplingConfig(max_new_tokens=new, **kwargs)
        where = jnp.ones(tokens.shape, bool)
        key = self.jax.random.key(seed)
        out = sample(self.graphdef, self.params, jnp.asarray(tokens), where, key, config)
        return np.asarray(out.tokens)

    def floor(self, batch: int, new: int) -> float:
        """Seconds a step of the weight matmuls alone takes at `batch` rows (median of 5)."""
        import jax
        import jax.numpy as jnp

        c = self.config
        h, d = c.hidden_size, c.head_dim
        groups = c.num_attention_heads // c.num_key_value_heads
        widths = [
            (h, c.num_attention_heads * d),
            (h, c.num_key_value_heads * d),
            (h, c.num_key_value_heads * d),
            (c.num_attention_heads * d, h),
            (h, c.intermediate_size),
            (h, c.intermediate_size),
            (c.intermediate_size, h),
        ]
        keys = iter(jax.random.split(jax.random.key(1), 8 * c.num_hidden_layers + 1))
        weights = [
            0.05 * jax.random.normal(next(keys), shape, jnp.float32)
            for _ in range(c.num_hidden_layers)
            for shape in widths
        ]
        head = 0.05 * jax.random.normal(next(keys), (h, c.vocab_size), jnp.float32)

        @jax.jit
        def run(x, weights, head):
            def step(_, x):
                total = jnp.zeros_like(x)
                for i in range(0, len(weights), 7):
                    q, k, v, o, g, u, dn = weights[i : i + 7]
                    attn = (x @ q + jnp.tile(x @ k + x @ v, groups)) @ o
                    total = total + attn + (x @ g + x @ u) @ dn
                return x + 1e-3 * total + 1e-3 * (x @ head)[:, :h]

            return jax.lax.fori_loop(0, new, step, x)

        x = jnp.ones((batch, h), jnp.float32)
        run(x, weights, head).block_until_ready()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            run(x, weights, head).block_until_ready()
            times.append(time.perf_counter() - start)
        return statistics.median(times) / new


class TunixWorker:
    def __init__(self, checkpoint: Path):
        import jax
        import jax.numpy as jnp
        from tunix.generate import sampler as sampler_lib

        self.model, self.config = tunix_qwen3(checkpoint)
        self.sampler_lib, self.jax, self.jnp = sampler_lib, jax, jnp
        self.tokenizer = IdTokenizer(self.config.vocab_size)
        self.samplers = {}
        self.versions = {"tunix": tunix_version(), "tunix_jax": jax.__version__}

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        jnp = self.jnp
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        logits, _ = self.model(jnp.asarray(tokens), positions, None, mask)
        return np.asarray(logits)

    def generate(self, tokens: np.ndarray, mode: str, new: int, seed: int) -> np.ndarray:
        prompt = tokens.shape[1]
        size = prompt + new
        if size not in self.samplers:
            cache = self.sampler_lib.CacheConfig(
                cache_size=size,
                num_layers=self.config.num_layers,
                num_kv_heads=self.config.num_kv_heads,
                head_dim=self.config.head_dim,
            )
            self.samplers[size] = self.sampler_lib.Sampler(self.model, self.tokenizer, cache)
        kwargs = {"temperature": 0.0} if mode == "greedy" else {"temperature": 1.0, "top_p": TOP_P}
        out = self.samplers[size](
            [self.tokenizer.decode(row) for row in tokens],
            max_generation_steps=new,
            max_prompt_length=prompt,
            eos_tokens=[-1],
            seed=seed,
            pad_output=True,
            **kwargs,
        )
        return np.asarray([np.asarray(row)[:new] for row in out.tokens])


class HFWorker:
    def __init__(self, checkpoint: Path):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32
        ).eval()
        self.versions = {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
        }

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        with self.torch.no_grad():
            return self.model(self.torch.tensor(tokens, dtype=self.torch.long)).logits.numpy()

    def generate(self, tokens: np.ndarray, mode: str, new: int, seed: int) -> np.ndarray:
        torch = self.torch
        ids = torch.tensor(tokens, dtype=torch.long)
        sampling = (
            {"do_sample": False}
            if mode == "greedy"
            else {"do_sample": True, "top_p": TOP_P, "top_k": 0, "temperature": 1.0}
        )
        torch.manual_seed(seed)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                min_new_tokens=new, eos_token_id=None, pad_token_id=0, **sampling,
            )  # fmt: skip
        return out[:, tokens.shape[1] :].numpy()


def serve(args: argparse.Namespace) -> int:
    """A worker: load the checkpoint, then answer one JSON request a line on stdin."""
    if args.worker == "tunelib":
        worker = TunelibWorker(args.checkpoint, args.scan_layers)
    elif args.worker == "tunix":
        worker = TunixWorker(args.checkpoint)
    else:
        worker = HFWorker(args.checkpoint)
    reply({"ready": True, "versions": worker.versions})
    for line in sys.stdin:
        request = json.loads(line)
        tokens = np.load(request["tokens"]) if "tokens" in request else None
        if request["op"] == "logits":
            np.save(request["out"], worker.logits(tokens).astype(np.float32))
            reply({})
        elif request["op"] == "generate":
            start = time.perf_counter()
            out = worker.generate(tokens, request["mode"], request["new"], request["seed"])
            seconds = time.perf_counter() - start
            if "out" in request:
                np.save(request["out"], out)
            reply({"seconds": seconds, "shape": list(out.shape)})
        elif request["op"] == "floor":
            reply({"seconds": worker.floor(request["batch"], request["new"])})
    return 0


# ----------------------------------------------------------------------------- the driver


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        return serve(args)
    smoke = args.size == "smoke"
    batches = args.batches or ((1, 2) if smoke else (1, 8, 32))
    new = args.new_tokens or (8 if smoke else 256)
    for name, value, low in (("--new-tokens", new, 2), ("--rounds", args.rounds, 1)):
        if value < low:
            raise SystemExit(f"{name} must be >= {low}, got {value}.")
    if args.prompt < 1:
        raise SystemExit(f"--prompt must be >= 1, got {args.prompt}.")
    pythons, missing = interpreters(args.anchors_python, LIBRARIES, "tunix, transformers, torch")
    load_before = load_average()

    with tempfile.TemporaryDirectory(prefix="sampler_anchors_") as scratch:
        scratch = Path(scratch)
        checkpoint = scratch / "qwen3"
        write_checkpoint(checkpoint, args.size)
        vocab = SIZES[args.size][-1]
        prompts = np.random.default_rng(SEED).integers(0, vocab, (max(batches), args.prompt))
        np.save(scratch / "prompts.npy", prompts.astype(np.int32))
        for b in batches:
            np.save(scratch / f"prompts_{b}.npy", prompts[:b].astype(np.int32))
        argv = ["--checkpoint", str(checkpoint)]
        argv.append("--scan-layers" if args.scan_layers else "--no-scan-layers")
        with started(pythons, __file__, argv) as workers:
            result = measure(args, workers, scratch, batches, new, missing)
    result["load_average_before"], result["load_average_after"] = load_before, load_average()
    report(result)
    print_result(result, args.json_out)
    return 0 if result["logits_agree"] and result["tokens_agree"] else 1


def measure(args, workers, scratch, batches, new, missing) -> dict:
    names = tuple(workers)
    # 1. Correctness: logits, then every batch's greedy tokens (also each one's warm-up).
    logits = {}
    for name, worker in workers.items():
        worker.ask(op="logits", tokens=str(scratch / "prompts.npy"), out=str(scratch / name))
        logits[name] = np.load(scratch / f"{name}.npy")
    differences = {
        f"{a}_vs_{b}": float(np.max(np.abs(logits[a] - logits[b])))
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    logits_agree = all(d <= args.logits_tol for d in differences.values())
    mismatches = {}
    cases = [(mode, b) for mode in args.modes for b in batches]
    for mode, b in cases:
        tokens = {}
        for name, worker in workers.items():
            out = scratch / f"{name}_{mode}_{b}.npy"
            worker.ask(
                op="generate", tokens=str(scratch / f"prompts_{b}.npy"), mode=mode, new=new,
                seed=SEED, out=str(out),
            )  # fmt: skip
            tokens[name] = np.load(out)
            if name == "tunelib":  # and tunelib's 1-token call, for the step time
                workers[name].ask(
                    op="generate", tokens=str(scratch / f"prompts_{b}.npy"), mode=mode, new=1,
                    seed=SEED,
                )  # fmt: skip
        shapes = {name: t.shape for name, t in tokens.items()}
        if any(s != (b, new) for s in shapes.values()):
            raise SystemExit(f"{mode} batch {b}: completions of shapes {shapes}, not {(b, new)}.")
        if mode == "greedy":
            for name in names[1:]:
                rows, cols = np.nonzero(tokens[name] != tokens["tunelib"])
                if rows.size:
                    r, c = int(rows[0]), int(cols[0])
                    mismatches[f"{name}_{b}"] = {"row": r, "position": c, "differing": rows.size}
    tokens_agree = not mismatches
    print(
        f"logits: largest differences {differences} (tolerance {args.logits_tol:g}); "
        f"greedy tokens {'identical' if tokens_agree else f'DIFFER: {mismatches}'}",
        file=sys.stderr,
        flush=True,
    )
    times = {(name, mode, b): [] for name in names for mode, b in cases}
    ones = {(mode, b): [] for mode, b in cases}
    # 2. Interleaved rounds.
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for mode, b in cases:
            for name in order:
                answer = workers[name].ask(
                    op="generate", tokens=str(scratch / f"prompts_{b}.npy"), mode=mode,
                    new=new, seed=SEED + 1 + r,
                )  # fmt: skip
                times[name, mode, b].append(answer["seconds"])
            answer = workers["tunelib"].ask(
                op="generate", tokens=str(scratch / f"prompts_{b}.npy"), mode=mode, new=1,
                seed=SEED + 1 + r,
            )  # fmt: skip
            ones[mode, b].append(answer["seconds"])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    floors = {b: workers["tunelib"].ask(op="floor", batch=b, new=new)["seconds"] for b in batches}
    table = []
    for mode, b in cases:
        row = {"mode": mode, "batch": b}
        for name in names:
            row[name] = b * new / statistics.median(times[name, mode, b])
        for name in names[1:]:
            row[f"vs_{name}"] = row["tunelib"] / row[name]
        t_n, t_1 = statistics.median(times["tunelib", mode, b]), statistics.median(ones[mode, b])
        row["step_ms"] = 1e3 * (t_n - t_1) / (new - 1)
        row["floor_ms"] = 1e3 * floors[b]
        row["step_over_floor"] = row["step_ms"] / row["floor_ms"]
        row["seconds"] = {name: times[name, mode, b] for name in names}
        table.append(row)
    meets = None
    if not missing:
        meets = all(row[f"vs_{n}"] >= TARGET for row in table for n in names[1:])
    case = {
        "size": args.size, "layers_hidden_heads_kv_headdim_mlp_vocab": SIZES[args.size],
        "prompt": args.prompt, "new_tokens": new, "rounds": args.rounds,
        "scan_layers": args.scan_layers, "top_p": TOP_P,
    }  # fmt: skip
    versions = {k: v for worker in workers.values() for k, v in worker.versions.items()}
    return {
        "case": case, "table": table, "logits_max_abs_diff": differences,
        "logits_agree": logits_agree, "tokens_agree": tokens_agree, "mismatches": mismatches,
        "anchors_skipped": missing, "versions": versions, "target": TARGET,
        "meets_target": meets,
    }  # fmt: skip


def report(result: dict) -> None:
    names = [n for n in LIBRARIES if n in result["table"][0]]
    header = ["mode", "batch", *names, *(f"vs {n}" for n in names[1:]), "step ms", "floor ms"]
    print(" | ".join(header))
    for row in result["table"]:
        cells = [row["mode"], str(row["batch"])]
        cells += [f"{row[n]:,.0f}" for n in names]
        cells += [f"{row[f'vs_{n}']:.2f}" for n in names[1:]]
        cells += [f"{row['step_ms']:.2f}", f"{row['floor_ms']:.2f}"]
        print(" | ".join(cells))
    print(f"versions: {result['versions']}; load {result['load_average_before']} -> "
          f"{result['load_average_after']}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
