"""Full fine-tuning or LoRA / QLoRA adapters on a model's projections, as `--lora-rank` says."""

import dataclasses

import jax

from tunelib import peft
from tunelib.models import PROJECTION_KERNELS

from kit.errors import UserError
from kit.models import save_model


@dataclasses.dataclass(frozen=True)
class Tuning:
    """What trains: `trainable` (the weights, or LoRA adapters) and the frozen `base` (None
    for full fine-tuning; quantised with `--qlora`)."""

    trainable: dict
    base: dict | None
    mode: str  # "full", "lora", "qlora" (NF4) or "qlora-gguf" (a GGUF file's blocks)

    @staticmethod
    def params(trainable: dict, base: dict | None, dropout_key=None) -> dict:
        """The parameters a forward pass runs with (call the forward through `peft.lora`):
        `trainable` on `base`, which is `Tuning.base` handed to the jitted function as one of
        its arguments. A base that the function closed over instead would be compiled into
        its program as constants: for QLoRA on SmolLM2, 42 s of compilation instead of 2.3 s
        (most of it compressing the 362 MB program for the compilation cache), and a cache
        entry holding the base's weights."""

        if base is None:
            return trainable
        return peft.apply_lora(base, trainable, dropout_key=dropout_key)

    def policy(self, trainable: dict) -> dict:
        """The parameters the sampler and evaluation run: the weights, or the base with the
        adapters beside it, never merged (`tunelib.rollout.sample` runs them through
        `peft.lora`; a quantised base stays quantised)."""

        return trainable if self.base is None else peft.apply_lora(self.base, trainable)

    def dense(self, trainable: dict) -> dict:
        """Plain weights for saving: adapters merged into the base."""

        return trainable if self.base is None else peft.merge_lora(self.base, trainable)

    def headline(self) -> dict:

        out = {
            "tuning": self.mode,
            "trainable_params": int(sum(x.size for x in jax.tree.leaves(self.trainable))),
        }
        if self.base is not None:
            out["base_bits_per_param"] = round(peft.bits_per_parameter(self.base), 3)
        return out

    def save(self, folder, model, trainable: dict, placed) -> None:
        """The trained model in `folder/model` (adapters merged; see `kit.models.save_model`)
        and, with LoRA, the adapters alone: Orbax (`adapters/`) and the PEFT format
        (`peft_adapter/`), written once from the arrays of `placed` (the run's
        `kit.parallel.Placement`). A model with fused experts (Gemma 4's, gpt-oss's), whose
        adapters PEFT's per-expert layout cannot hold, gets no `peft_adapter/`."""

        save_model(folder / "model", model, self.dense(trainable))
        if self.base is None:
            return
        peft.save_adapters(folder / "adapters", trainable)
        config = model.config
        if config.num_experts and (config.parallel_moe or config.biased_experts):
            return
        # The layers each stack holds, when they are scanned (by groups where shapes differ);
        # unrolled layers are named by their paths.
        stacks = config.layer_stacks if config.scan_layers else None
        if placed.process_count == 1:
            peft.export_peft(folder / "peft_adapter", trainable, self.base, layer_stacks=stacks)
            return
        trainable, base = placed.fetch(trainable), placed.fetch(self.base)  # on every host
        if placed.is_main:  # then one writer
            peft.export_peft(folder / "peft_adapter", trainable, base, layer_stacks=stacks)
        placed.barrier("peft adapter written")


def tuning(
    model,
    placement,
    *,
    rank: int,
    alpha: float | None = None,
    dropout: float = 0.0,
    qlora: bool = False,
    seed: int = 0,
) -> Tuning:
    """Full fine-tuning (`rank` 0), or fresh adapters of `rank` (`alpha`, default 2 x rank;
    `dropout` on their inputs; initialised from `seed`) on every attention and MLP projection
    of `model` (a `kit.models.Model`), on every device of `placement` (a
    `kit.parallel.Placement`). With `qlora` the frozen projections are NF4, or, for a model
    loaded from a GGUF file, the file's own Q8_0 / Q4_0 / Q4_1 blocks."""
    made = _tuning(model, rank, alpha, dropout, qlora, seed)
    return dataclasses.replace(
        made, trainable=placement.replicate(made.trainable), base=placement.replicate(made.base)
    )


def _tuning(model, rank, alpha, dropout, qlora, seed) -> Tuning:

    params = model.params
    if not rank:
        return Tuning(params, None, "full")
    if rank > (width := model.config.hidden_size):  # before the adapters are allocated
        raise UserError(
            f"--lora-rank {rank} is above the model's hidden size {width}: every projection "
            f"LoRA adapts has the hidden size on one side, so a higher rank adds parameters, "
            f"not capacity (ranks of 8 to 64 are usual)"
        )
    # A vision-language model's language model holds the projections; its vision encoder
    # stays frozen.
    targets = f"language_model/{PROJECTION_KERNELS}" if model.images else PROJECTION_KERNELS
    rule = peft.LoraRule(pattern=targets, rank=rank, alpha=alpha or 2.0 * rank, dropout=dropout)
    adapters = peft.init_lora(params, [rule], key=jax.random.key(seed + 1))
    if not qlora:
        return Tuning(adapters, params, "lora")
    if model.folder is not None and model.folder.is_file():  # a GGUF file: keep its blocks
        base = peft.gguf_base(model.folder, scan_layers=model.config.scan_layers).params
        return Tuning(adapters, base, "qlora-gguf")
    return Tuning(adapters, peft.quantize_params(params, [targets]), "qlora")
