"""The flags of the two GRPO recipes (`recipes/grpo.py`, synchronous, and
`recipes/grpo_async.py`, disaggregated), the three modes and the user's reward function.

Nothing here imports JAX: the flags are checked before it is imported.
"""

import dataclasses
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from kit.config import (
    CHECKPOINT_EVERY,
    DataFile,
    Lora,
    RLEvaluation,
    RoutingReplay,
    Run,
    SFTStart,
    Task,
    VisionTask,
    at_least,
    flag,
)
from kit.errors import UserError
from kit.reward_model import check_folder

# What each mode sets; every value can be overridden by its flag.
MODES = {
    # Shao et al. 2024: group-normalised advantages, symmetric clip, k3 KL, per-sequence mean.
    "grpo": {"scale": "group", "aggregation": "seq_mean_token_mean", "epsilon_high": 0.2,
             "kl_coef": 0.04, "overlong_buffer": 0, "dynamic_sampling": False},
    # Yu et al. 2025: clip-higher, no KL, token mean, soft overlong penalty, dynamic sampling.
    "dapo": {"scale": "group", "aggregation": "token_mean", "epsilon_high": 0.28,
             "kl_coef": 0.0, "overlong_buffer": 2, "dynamic_sampling": True},
    # Liu et al. 2025: advantages not divided by the std, token sum / max length, no KL.
    "dr_grpo": {"scale": "none", "aggregation": "seq_mean_token_sum_norm", "epsilon_high": 0.2,
                "kl_coef": 0.0, "overlong_buffer": 0, "dynamic_sampling": False},
}  # fmt: skip


def load_reward(spec: str) -> Callable[[str, dict], float]:
    """The function `module:function` or `path/to/file.py:function` names; loading it writes
    nothing (no `__pycache__` beside the user's file)."""
    previous, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        return _load_reward(spec)
    finally:
        sys.dont_write_bytecode = previous


def _load_reward(spec: str) -> Callable[[str, dict], float]:
    source, _, name = spec.rpartition(":")
    if not source or not name:
        raise UserError(f"--reward {spec}: give module:function or file.py:function")
    if source.endswith(".py"):
        path = Path(source)
        if not path.is_file():
            raise UserError(f"--reward {spec}: no such file {path}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as error:  # the user's file: report it in one line
            raise UserError(f"--reward {spec}: {path} failed to load: {error!r}") from None
    else:
        sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(source)
        except ImportError as error:
            raise UserError(f"--reward {spec}: {error}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"--reward {spec}: {source} has no function {name!r}")
    try:
        inspect.signature(function).bind("completion", {})
    except TypeError:
        raise UserError(
            f"--reward {spec}: {name} must take (completion: str, record: dict)"
        ) from None
    return function


@dataclasses.dataclass(kw_only=True)
class GRPOConfig(Run, Task, VisionTask, DataFile, SFTStart, Lora, RLEvaluation, RoutingReplay):
    RECIPE = "grpo"
    LEARNING_RATE = 1e-4
    LORA_LEARNING_RATE = 1e-3

    steps: int = flag(150, "optimizer steps (batches of rollouts)")
    eval_every: int = flag(50, "steps between held-out evaluations")
    checkpoint_every: int | Literal["auto"] = flag(50, CHECKPOINT_EVERY)
    mode: Literal["grpo", "dapo", "dr_grpo"] = flag("grpo", "the algorithm's defaults")
    group_size: int = flag(8, "completions per prompt, G")
    temperature: float = flag(1.0, "sampling temperature (> 0: the G completions must differ)")
    decoding_layout: Literal["stacked", "per_layer"] = flag(
        "stacked",
        "how the rollouts' decode steps read a stacked model's layers: per_layer reads each "
        "layer's weights in place (faster steps on CPU, a longer compile, the weights held "
        "twice while sampling; slower on a GPU); LoRA and quantised bases always scan",
    )
    decoding_products: Literal["blocked", "plain"] = flag(
        "blocked",
        "how the rollouts' float32 products add up on CPU: blocked as the trainer's, or plain "
        "(one dot each: faster decode steps at many rows, logits rounded as XLA's dot does)",
    )
    epsilon_low: float = flag(0.2, "lower clip bound of the ratio")
    epsilon_high: float | None = flag(None, "upper clip bound (default: the mode's)")
    kl_coef: float | None = flag(
        None, "weight of the k3 KL penalty (default: the mode's)", aliases=("--kl-beta",)
    )
    updates_per_batch: int = flag(
        1, "optimizer steps on each batch of rollouts (PPO epochs); > 1 makes the clip bind"
    )
    format_weight: float = flag(0.1, "built-in task: reward of a well-formed answer")
    reward: str | None = flag(
        None, "your reward function, module:function or file.py:function (see the docstring)"
    )
    reward_model: Path | None = flag(
        None, "score completions with this reward model (a run of recipes/reward_model.py)"
    )
    num_prompts: int = flag(9000, "built-in task: training prompts sampled from")
    max_new_tokens: int = flag(
        64, "the most tokens of a sampled completion (the built-in task's room may be less)"
    )
    is_correction: Literal[
        "auto",
        "none",
        "tis",
        "token-tis",
        "token-mis",
        "seq-tis",
        "seq-mis",
        "seq-tis-rs",
        "geo-rs",
        "icepop",
    ] = flag(
        "auto",
        "correct for the sampler's policy with the trainer's log-probs before the update: "
        "tis truncates their token ratios over the sampler's at --is-cap; the others are "
        "tunelib.losses.ROLLOUT_CORRECTIONS (docs/rollout_correction.md); auto is tis when "
        "--max-staleness > 0 (recipes/grpo_async.py), else none",
    )
    is_cap: float = flag(2.0, "with --is-correction tis: the cap C of the importance weights")
    target_entropy: float | None = flag(
        None,
        "steer the policy's entropy (nats/token) toward this with an entropy bonus whose "
        "weight adapts each step (Skywork-OR1's adaptive entropy control); default: no bonus",
    )
    entropy_step: float = flag(1e-4, "with --target-entropy: the weight's step per update")
    max_entropy_weight: float = flag(0.005, "with --target-entropy: the weight's upper bound")

    def run_name(self) -> str:
        return ("grpo" if self.mode == "grpo" else f"grpo-{self.mode}") + self.task_suffix()

    def stale(self) -> bool:
        """Whether rollouts may come from older weights than the trained ones."""
        return False

    def check(self) -> None:
        super().check()
        at_least("group_size", self.group_size, 2)
        at_least("updates_per_batch", self.updates_per_batch, 1)
        at_least("max_new_tokens", self.max_new_tokens, 1)
        at_least("num_prompts", self.num_prompts, 1)
        self.check_staleness()
        if not self.is_cap > 0:
            raise UserError(f"--is-cap must be > 0, got {self.is_cap}")
        if self.target_entropy is not None and not self.target_entropy > 0:
            raise UserError(f"--target-entropy must be > 0, got {self.target_entropy}")
        if not self.entropy_step > 0:
            raise UserError(f"--entropy-step must be > 0, got {self.entropy_step}")
        if not self.max_entropy_weight >= 0:
            raise UserError(f"--max-entropy-weight must be >= 0, got {self.max_entropy_weight}")
        if self.is_correction == "auto":
            self.is_correction = "tis" if self.stale() else "none"
        if self.is_cap != 2.0 and self.is_correction != "tis":
            what = "corrects nothing" if self.is_correction == "none" else "has its own thresholds"
            raise UserError(
                f"--is-cap is the cap of --is-correction tis; {self.is_correction} {what} "
                f"(docs/losses/rollout_correction.md)"
            )
        if not self.temperature > 0:
            raise UserError(
                f"--temperature must be > 0 (GRPO needs G different completions per prompt), "
                f"got {self.temperature}"
            )
        mode = MODES[self.mode]
        self.epsilon_high = mode["epsilon_high"] if self.epsilon_high is None else self.epsilon_high
        self.kl_coef = mode["kl_coef"] if self.kl_coef is None else self.kl_coef
        if self.epsilon_low < 0 or self.epsilon_high < 0 or self.kl_coef < 0:
            raise UserError("--epsilon-low, --epsilon-high and --kl-coef must be >= 0")
        if self.reward is not None:
            load_reward(self.reward)
        if self.reward_model is not None:
            if self.reward is not None:
                raise UserError("--reward and --reward-model are two rewards: pass one")
            check_folder(self.reward_model)

    def check_staleness(self) -> None:
        """The disaggregated recipe's `--max-staleness` check (none here)."""
