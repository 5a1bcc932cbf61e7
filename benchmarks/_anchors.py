"""What the side-by-side scripts against Tunix and transformers (`sampler_anchors.py`,
`grpo_anchors.py`) share: the tiny Qwen3-shaped model written once as a Hugging Face
checkpoint, Tunix's model loaded from it, a tokenizer over strings of ids, and the worker
processes (one library each, driven a JSON request a line over standard input and output).

A module beside the scripts, not a script: `python benchmarks/<script>.py` puts this folder
first on `sys.path`, so the scripts (and their worker subprocesses, in the anchors' own
environment too) import it as `_anchors`. Nothing here imports tunelib, JAX or torch at the
top: the anchors' environment has no tunelib.
"""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

SEED = 0
# name: (layers, hidden, query heads, kv heads, head width, MLP, vocabulary)
SIZES = {
    "default": (4, 256, 8, 4, 32, 768, 1024),
    "smoke": (2, 64, 4, 2, 16, 128, 128),
}


def write_checkpoint(directory: Path, size: str) -> None:
    """A Qwen3-style decoder of `size` (QK-norm, SwiGLU, untied head, float32), randomly
    initialised by tunelib from `SEED`, saved as a Hugging Face Qwen3 checkpoint."""
    from flax import nnx

    from tunelib.formats import save_hf_checkpoint
    from tunelib.models import Decoder, DecoderConfig

    layers, hidden, heads, kv_heads, head_dim, mlp, vocab = SIZES[size]
    config = DecoderConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        use_qk_norm=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    )
    graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(SEED)))
    save_hf_checkpoint(directory, graphdef, params, model_type="qwen3")


def tunix_qwen3(checkpoint: Path):
    """`(model, config)`: Tunix's Qwen3 of the checkpoint, float32, on no mesh."""
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as qwen3_model
    from tunix.models.qwen3 import params as qwen3_params

    hf = json.loads((checkpoint / "config.json").read_text())
    config = qwen3_model.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(hf["rope_theta"]),
        norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=hf["tie_word_embeddings"],
    )
    model = qwen3_params.create_model_from_safe_tensors(
        str(checkpoint), config, mesh=None, dtype=jnp.float32
    )
    return model, config


def tunix_version() -> str:
    import tunix

    version = getattr(tunix, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("google-tunix")
    return version


class IdTokenizer:
    """Tunix's tokenizer protocol over strings of ids: "5 17 3" <-> [5, 17, 3]."""

    def __init__(self, vocab_size: int):
        self.pad = vocab_size  # outside the vocabulary: never drawn, never fed

    def encode(self, text: str, **_) -> list[int]:
        return [int(x) for x in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(x)) for x in ids)

    def bos_id(self) -> int:
        return 0  # falsy: Tunix then adds no BOS

    def eos_id(self) -> int:
        return -1

    def pad_id(self) -> int:
        return self.pad


_channel = None  # the worker's answers, once `claim_stdout` has moved them off stdout


def claim_stdout() -> None:
    """Keep the process's standard output for `reply` alone: whatever a library prints to
    it from now on (progress bars, notices) goes to standard error instead."""
    global _channel
    sys.stdout.flush()
    _channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)


def reply(message: dict) -> None:
    """A worker's answer: one JSON line on its standard output."""
    stream = sys.stdout if _channel is None else _channel
    stream.write(json.dumps(message) + "\n")
    stream.flush()


class Worker:
    """A library's process, `python SCRIPT --worker NAME ARGS`: requests in, replies out, one
    at a time. Its first line says it is ready and gives its libraries' versions."""

    def __init__(self, name: str, python: str, script: str, args: list[str]):
        env = dict(os.environ)
        if name != "tunelib":  # the anchors' own environment, nothing of ours on its path
            env.pop("PYTHONPATH", None)
        self.name = name
        self.process = subprocess.Popen(
            [python, script, "--worker", name, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.versions = self.read()["versions"]

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} worker ended (exit status {self.process.wait()}).")
        return json.loads(line)

    def ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


@contextlib.contextmanager
def started(pythons: dict[str, str], script: str, args: list[str]):
    """`{name: Worker}`, one process per library of `pythons` (`{name: interpreter}`),
    each ended when the block ends."""
    workers = {}
    try:
        for name, python in pythons.items():
            print(f"starting the {name} worker ...", file=sys.stderr, flush=True)
            workers[name] = Worker(name, python, script, args)
        yield workers
    finally:
        for worker in workers.values():
            worker.close()


def interpreters(anchors: Path | None, libraries: tuple[str, ...], modules: str):
    """`({library: interpreter}, why)`: tunelib (the first of `libraries`) in this
    interpreter, the anchors in `anchors`; only tunelib, with the line that says why (printed
    here), when `anchors` cannot import `modules` ("a, b"); `why` is None otherwise."""
    missing = anchors_missing(anchors, modules)
    if missing:
        print(f"anchors skipped: {missing}; tunelib measured alone.", flush=True)
        return {libraries[0]: sys.executable}, missing
    return {libraries[0]: sys.executable} | dict.fromkeys(libraries[1:], str(anchors)), None


def anchors_missing(python: Path | None, modules: str) -> str | None:
    """Why the anchors cannot run (`python` cannot import `modules`, "a, b"), or None."""
    if python is None:
        return "no --anchors-python given"
    if not python.exists():
        return f"--anchors-python {python} does not exist"
    check = subprocess.run([str(python), "-c", f"import {modules}"], capture_output=True, text=True)
    if check.returncode:
        last = (check.stderr.strip().splitlines() or ["?"])[-1]
        return f"{python} cannot import {modules} ({last})"
    return None


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
