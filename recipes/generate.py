"""Generate from a trained model: completions of prompts, or a chat.

    python recipes/generate.py --model runs/sft-seed0 --prompt "12+7=" --prompt "40+2="
    python recipes/generate.py --model runs/grpo-seed0 --prompts problems.txt --jsonl
    python recipes/generate.py --model HF_CHECKPOINT --chat --temperature 0.7 --top-p 0.9

`--model` is any run folder (its `model/`), a model folder, or a Hugging Face checkpoint.
Prompts are plain text, tokenized as the recipes tokenize prompts (BOS where the tokenizer
adds one); `--chat` renders a conversation with the model's chat template, one user turn per
line you type (an empty line or end of input ends it). Sampling uses `tunelib.rollout.sample`
with the usual processors; temperature 0 (the default) is greedy.
"""

import dataclasses
import json
import sys
from pathlib import Path

import kit
from kit.config import MODELS, Config, flag
from kit.errors import UserError


@dataclasses.dataclass(kw_only=True)
class GenerateConfig(Config):
    RECIPE = "generate"

    model: Path | None = flag(None, f"the model: {MODELS}")
    prompt: tuple[str, ...] = flag((), "a prompt (repeat the flag for more)")
    prompts: Path | None = flag(
        None, "a file of prompts: one per line, or .jsonl records with 'prompt'"
    )
    chat: bool = flag(False, "chat with the model on the terminal (needs a chat template)")
    jsonl: bool = flag(False, "print one JSON line per completion instead of text")
    max_new_tokens: int = flag(64, "the most tokens of a completion")
    max_prompt_tokens: int = flag(512, "the most tokens of a prompt (or of the conversation)")
    num_samples: int = flag(1, "completions per prompt")
    temperature: float = flag(0.0, "sampling temperature; 0 is greedy")
    top_k: int | None = flag(None, "keep the k most likely tokens")
    top_p: float | None = flag(None, "nucleus sampling: keep the most likely mass p")
    min_p: float | None = flag(None, "keep tokens at least min_p times the most likely")
    seed: int = flag(0, "seed of the sampler")

    def check(self) -> None:
        from kit.models import model_folder

        if self.model is None:
            raise UserError("--model is required: a run folder, a model folder or a checkpoint")
        model_folder(self.model)
        if self.chat == bool(self.prompt or self.prompts):
            raise UserError("give prompts (--prompt or --prompts) or --chat, not both or neither")
        if self.prompts is not None:
            kit.config.existing_file("prompts", self.prompts)
        kit.config.at_least("max_new_tokens", self.max_new_tokens, 1)
        kit.config.at_least("max_prompt_tokens", self.max_prompt_tokens, 1)
        kit.config.at_least("num_samples", self.num_samples, 1)
        if not self.temperature >= 0:
            raise UserError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None:
            kit.config.at_least("top_k", self.top_k, 1)
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must lie in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise UserError(f"--min-p must lie in [0, 1], got {self.min_p}")

    def sampling(self, *, stop_tokens, pad_token):
        from tunelib.rollout import SamplingConfig

        return SamplingConfig(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, min_p=self.min_p, stop_tokens=tuple(stop_tokens),
            pad_token=pad_token,
        )  # fmt: skip


def read_prompts(path: Path) -> list[str]:
    """The prompts of a text file (one per line) or a JSON-lines file (`prompt` fields)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:  # a binary file, or text in another encoding
        raise UserError(
            f"--prompts {path}: not UTF-8 text (byte {error.start}: {error.reason}); give a "
            "text file of prompts, one per line, or .jsonl records"
        ) from None
    lines = [line for line in text.splitlines() if line.strip()]
    if path.suffix.lower() != ".jsonl":
        return lines
    prompts = []
    for number, line in enumerate(lines, start=1):
        try:
            prompts.append(json.loads(line)["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"--prompts {path}: line {number} has no 'prompt'") from None
    return prompts


def generate(config: GenerateConfig, _run: None) -> list[dict]:
    import jax
    import numpy as np

    from tunelib import rollout
    from tunelib.data import encode_prompts

    from kit import models

    model = models.load_model(config.model)
    tok = model.tokenizer
    sampling = dataclasses.replace(
        config.sampling(stop_tokens=tok.stop_ids, pad_token=tok.pad_id),
        forbidden_tokens=tuple(range(tok.vocab_size, model.config.vocab_size)),
    )
    key = jax.random.key(config.seed)

    def complete(prompts: list) -> list[list[str]]:
        nonlocal key
        try:
            tokens, where = encode_prompts(prompts, tok, max_length=config.max_prompt_tokens)
        except ValueError as error:
            raise UserError(str(error)) from None
        longest, context = int(where.sum(axis=1).max()), model.config.max_position_embeddings
        if longest + config.max_new_tokens > context:
            raise UserError(
                f"a prompt of {longest} tokens and --max-new-tokens {config.max_new_tokens} "
                f"are longer than the model's context of {context} tokens; lower them"
            )
        key, sample_key = jax.random.split(key)
        out = rollout.sample(
            model.graphdef, model.params, tokens, where, sample_key, sampling,
            group_size=config.num_samples,
        )  # fmt: skip
        texts = [tok.decode(row) for row in np.asarray(out.tokens).tolist()]
        return [texts[i : i + config.num_samples] for i in range(0, len(texts), config.num_samples)]

    if config.chat:
        if tok.chat_template is None:
            raise UserError(
                f"--chat: the model in {config.model} has no chat template; use --prompt"
            )
        conversation = []
        for line in sys.stdin:
            if not line.strip():
                break
            conversation.append({"role": "user", "content": line.rstrip("\n")})
            answer = complete([conversation])[0][0]
            conversation.append({"role": "assistant", "content": answer})
            print(answer, flush=True)
        return conversation
    prompts = list(config.prompt) + (read_prompts(config.prompts) if config.prompts else [])
    results = []
    for first in range(0, len(prompts), 64):
        chunk = prompts[first : first + 64]
        for prompt, samples in zip(chunk, complete(chunk), strict=True):
            for sample in samples:
                results.append({"prompt": prompt, "completion": sample})
                print(json.dumps(results[-1]) if config.jsonl else f"{prompt}{sample}", flush=True)
    return results


if __name__ == "__main__":
    kit.cli.main(GenerateConfig, generate, __doc__)
