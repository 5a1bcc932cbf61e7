"""The model a recipe trains: made from scratch, or loaded from a folder, and saved.

A model folder is either what a recipe saves (`model/`: `config.json` with the decoder's
fields, Orbax `params/`, and its tokenizer) or a Hugging Face checkpoint (`config.json` with a
`model_type`, safetensors, `tokenizer.json`). `--model` may also name a run folder, whose
`hf_model/` (a run that started from a Hugging Face checkpoint) or `model/` is meant.
Whether a path is a model is decided from its files alone (`model_folder`, no JAX), so a
wrong path stops a recipe before any work.
"""

import dataclasses
import json
from pathlib import Path

from kit.errors import UserError

# Qwen3-style decoders (QK-norm, tied embeddings) of three sizes for the built-in task:
# "base" learns it in a minute on two CPU cores; "teacher" and "student" are the pair of the
# distillation recipe.
MODEL_SIZES = {
    "student": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    "base": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    "teacher": {"hidden_size": 192, "intermediate_size": 576, "num_hidden_layers": 3,
                "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32},
}  # fmt: skip


def _is_hf_checkpoint(folder: Path) -> bool:
    config = folder / "config.json"
    if not config.is_file():
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def model_folder(path: Path, flag: str = "--model") -> Path:
    """The model folder `path` names (a run folder means its `model/`), or a `UserError`."""
    if not path.exists():
        raise UserError(f"{flag} {path}: no such file or folder")
    if not (path / "config.json").exists():  # a run folder: its Hugging Face export, or model/
        for inner in ("hf_model", "model"):
            if (path / inner).is_dir():
                path = path / inner
                break
    if not path.is_dir():
        raise UserError(f"{flag} {path}: not a model folder")
    if (path / "config.json").is_file() and (path / "params").is_dir():
        return path
    if _is_hf_checkpoint(path) and any(path.glob("*.safetensors")):
        return path
    raise UserError(
        f"{flag} {path} is not a model: give a run folder, its model/ folder (config.json and "
        "params/) or a Hugging Face checkpoint (config.json and .safetensors files)"
    )


@dataclasses.dataclass(frozen=True)
class Model:
    """A decoder with its tokenizer, and where it came from.

    Attributes:
      config: the `DecoderConfig`.
      graphdef, params: `nnx.merge(graphdef, params)` is the decoder.
      tokenizer: its tokenizer (any `tunelib.data.Tokenizer`).
      folder: the folder it was loaded from, or None for a new model.
      hf_config: the Hugging Face `config.json` when it came from one (the run then also
        saves a Hugging Face checkpoint), else None.
    """

    config: object
    graphdef: object
    params: dict
    tokenizer: object
    folder: Path | None = None
    hf_config: dict | None = None


def new_model(tokenizer, size: str, seed: int) -> Model:
    """A freshly initialised decoder of one of `MODEL_SIZES` for `tokenizer`'s vocabulary."""
    from flax import nnx

    from tunelib.models import Decoder, DecoderConfig

    config = DecoderConfig(
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        use_qk_norm=True,
        **MODEL_SIZES[size],
    )
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(seed)))
    return Model(config, graphdef, nnx.to_pure_dict(state), tokenizer)


def _tokenizer(folder: Path):
    """The tokenizer saved with a model; the character tokenizer for recipe models saved
    before models carried their tokenizer."""
    from tunelib.data import CharTokenizer, load_tokenizer

    try:
        return load_tokenizer(folder)
    except FileNotFoundError:
        return CharTokenizer()
    except ValueError as error:
        raise UserError(str(error)) from None


def load_model(path: Path) -> Model:
    """The model in `path` (checked with `model_folder` first)."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from tunelib.models import Decoder, DecoderConfig, load_hf_checkpoint

    folder = model_folder(path)
    if _is_hf_checkpoint(folder):
        checkpoint = load_hf_checkpoint(folder)
        return Model(
            checkpoint.config, checkpoint.graphdef, checkpoint.params, _tokenizer(folder),
            folder, checkpoint.hf_config,
        )  # fmt: skip
    config = DecoderConfig(**json.loads((folder / "config.json").read_text()))
    graphdef, template = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
    template = nnx.to_pure_dict(template)
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(
            (folder / "params").resolve(), jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        )
    return Model(config, graphdef, params, _tokenizer(folder), folder)


def start_model(path: Path | None, size: str, seed: int) -> Model:
    """The model in `path`, or a new one of `size` for the built-in task's character
    tokenizer when `path` is None."""
    if path is not None:
        return load_model(path)
    from tunelib.data import CharTokenizer

    return new_model(CharTokenizer(), size, seed)


def save_model(folder: Path, model: Model, params: dict) -> None:
    """`params` as a recipe model folder (`config.json`, Orbax `params/`, the tokenizer), and
    as a Hugging Face checkpoint in `hf_model/` beside it when the model came from one."""
    import orbax.checkpoint as ocp

    from tunelib.models import save_hf_checkpoint

    folder = folder.resolve()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(folder / "params", params, force=True)
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(model.config), indent=2))
    if hasattr(model.tokenizer, "save"):
        model.tokenizer.save(folder)
    if model.hf_config is not None:
        save_hf_checkpoint(
            folder.parent / "hf_model", model.graphdef, params, hf_config=model.hf_config,
            copy_files_from=model.folder, overwrite=True,
        )  # fmt: skip
