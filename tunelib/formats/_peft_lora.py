"""The Hugging Face PEFT LoRA format on disk: `adapter_config.json` and
`adapter_model.safetensors`, as one pair of factor matrices per module."""

import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_FACTOR = re.compile(r"(.+)\.lora_(A|B)\.weight")
# The fields of every LoRA adapter tunelib writes: its kind, before the LoRA fields, and how
# the factors are applied and loaded, after them.
_KIND = {"peft_type": "LORA", "task_type": "CAUSAL_LM"}
_FIXED = {
    "bias": "none",
    "fan_in_fan_out": False,
    "init_lora_weights": True,
    "modules_to_save": None,
    "use_dora": False,
    "inference_mode": True,
}


def write_peft_lora(
    directory: str | os.PathLike,
    factors: Mapping[str, tuple[np.ndarray, np.ndarray]],
    config: Mapping[str, Any],
) -> None:
    """Write LoRA factors as a Hugging Face PEFT adapter directory.

    Each module's factors are stored as `base_model.model.<module>.lora_A.weight` and
    `...lora_B.weight` in `adapter_model.safetensors` (float16 and float32 as they are, other
    dtypes as float32), the layout of `peft.LoraModel`. `adapter_config.json` holds `config`
    between the fields every such adapter has (`peft_type` LORA, `task_type` CAUSAL_LM before;
    `bias` none, no fan-in-fan-out, no DoRA, inference mode after). The directory is written
    in full next to `directory` and renamed into place (replacing one that exists), so a crash
    never leaves a partial adapter. `tunelib.peft.export_peft` writes a model's adapters
    through this function.

    Args:
      directory: the output directory.
      factors: module name -> `(lora_A [r, in], lora_B [out, r])`, PEFT's matrices.
      config: the LoRA fields of `adapter_config.json`: `r`, `lora_alpha`, `lora_dropout`,
        `use_rslora`, `target_modules`, `rank_pattern`, `alpha_pattern`,
        `base_model_name_or_path`.

    Examples:
      >>> import tempfile, numpy as np
      >>> from tunelib.formats import read_peft_lora, write_peft_lora
      >>> a, b = np.ones((2, 3), np.float32), np.zeros((4, 2), np.float32)
      >>> folder = tempfile.mkdtemp() + "/adapter"
      >>> write_peft_lora(folder, {"model.layers.0.mlp.up_proj": (a, b)},
      ...                 {"r": 2, "lora_alpha": 4, "target_modules": ["up_proj"]})
      >>> config, read = read_peft_lora(folder)
      >>> config["peft_type"], config["r"], read["model.layers.0.mlp.up_proj"][1].shape
      ('LORA', 2, (4, 2))
    """
    tensors = {}
    for module, (lora_a, lora_b) in factors.items():
        for factor, value in (("A", lora_a), ("B", lora_b)):
            value = np.asarray(value)
            if value.dtype not in (np.float16, np.float32):
                value = value.astype(np.float32)
            tensors[f"{_PREFIX}{module}.lora_{factor}.weight"] = np.ascontiguousarray(value)
    document = {**_KIND, **config, **_FIXED}
    directory = Path(directory).resolve()
    staging = directory.with_name(f".{directory.name}.tmp-{uuid.uuid4().hex}")
    staging.mkdir(parents=True)
    try:
        save_file(tensors, str(staging / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / PEFT_CONFIG_FILE).write_text(json.dumps(document, indent=2) + "\n")
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old-{uuid.uuid4().hex}")
            directory.rename(old)
            staging.rename(directory)
            shutil.rmtree(old)
        else:
            staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_peft_lora(
    directory: str | os.PathLike,
) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The config and the factors of a Hugging Face PEFT LoRA adapter directory.

    The inverse of `write_peft_lora`. An adapter of another PEFT type, a DoRA adapter, a
    tensor that is not a LoRA factor, or a factor without its partner is an error naming it.
    `tunelib.peft.import_peft` reads adapters for a model's weights through this function.

    Args:
      directory: a directory with `adapter_config.json` and `adapter_model.safetensors`.

    Returns:
      `(config, factors)`: the parsed `adapter_config.json`, and module name ->
      `(lora_A [r, in], lora_B [out, r])`.
    """
    directory = Path(directory)
    config = json.loads((directory / PEFT_CONFIG_FILE).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{directory} holds a {config['peft_type']} adapter, not LORA.")
    if config.get("use_dora"):
        raise ValueError(f"{directory} holds a DoRA adapter, which tunelib does not implement.")
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, value in load_file(str(directory / PEFT_WEIGHTS_FILE)).items():
        match = _FACTOR.fullmatch(name.removeprefix(_PREFIX))
        if not name.startswith(_PREFIX) or match is None:
            raise ValueError(
                f"{PEFT_WEIGHTS_FILE} has a tensor {name!r} that is not a LoRA factor."
            )
        pairs.setdefault(match.group(1), {})[match.group(2)] = value
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"module {module!r} has lora_{next(iter(pair))} but not its partner.")
    return config, {module: (pair["A"], pair["B"]) for module, pair in pairs.items()}
