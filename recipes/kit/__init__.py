"""The recipe kit: what every recipe shares, each part in its own module.

- `config`: one dataclass per recipe is its flags, `--help`, `--config file.toml` and the
  `config.toml` of its run; flag groups (`Run`, `Task`, `DataFile`, `Start`, `Lora`,
  `RLEvaluation`).
- `cli`: the entry point: parse and check before JAX is imported, one-line errors, Ctrl-C.
- `compile_cache`: JAX's persistent compilation cache beside the run, so restarts skip
  compiling.
- `runs`: run folders that are never replaced without `--overwrite` or `--resume`, and
  `--resume auto`.
- `lock`: a run folder's lock: one run writes it at a time.
- `chain`: the SFT runs a recipe trains first (its start, a teacher, a baseline).
- `children`: those runs as processes that stop with the recipe (Ctrl-C, SIGTERM, SIGKILL).
- `models`: the start model (new, a recipe's `model/`, a Hugging Face checkpoint) and saving.
- `data`: the built-in task or a data file, as records and batches.
- `images`: records with images laid out for a Gemma 4 vision-language model.
- `lora`: full fine-tuning or LoRA / QLoRA adapters.
- `optim`: the optimizer.
- `evaluate`: greedy accuracy, held-out means, and an RL recipe's sampled metrics (pass@k,
  maj@k, entropy, diversity).
- `watch`: after each evaluation, the entropy-collapse guard and `--keep-best`.
- `pairs`: preference pairs: both sides' log-probs, on-policy negatives.
- `reward_model`: a decoder with a score head: its rewards, saving and loading.
- `loop`: the run context a recipe's own loop runs in (`Steps`: resume, log, checkpoint,
  heartbeats, faults, Ctrl-C, the time split), the step's PRNG keys and the result line.
- `logs`, `plots`, `checkpoints`: metrics writers, the curves, Orbax checkpoints.
- `goodput`: each step's time split by phase.
- `grpo_config`, `grpo`: what the two GRPO recipes share: flags, sampler, rewards, updates.
- `parallel`, `disaggregated`: the mesh over every process's devices; GRPO's two roles.
- `plan`: `--plan` and `--device-memory`, the step's memory planned before it runs.

The modules a recipe imports before its flags are checked (`config`, `cli`, `runs`, `lock`,
`errors`, and through them `children`, `compile_cache`, `plan`, `models`, `reward_model`,
`grpo_config`) do not import JAX at their top; the others do, and are imported by the
recipes' `train`.
"""

from kit import cli, config, errors, runs

__all__ = ["cli", "config", "errors", "runs"]
