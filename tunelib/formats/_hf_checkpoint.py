"""Hugging Face checkpoints (`config.json` + safetensors) into the decoder and back."""

import itertools
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jaxtyping import PyTree

from tunelib.formats._hf_config import config_from_hf, config_to_hf
from tunelib.formats._load_options import LoadOptions
from tunelib.formats._safetensors import (
    FLOAT_DTYPES,
    TensorFiles,
    TensorSource,
    TensorToWrite,
    write_tensors,
)
from tunelib.models import (
    Decoder,
    DecoderConfig,
    hf_module_name,
    param_shardings,
)

# Buffers that old `transformers` releases saved with Llama weights; they are recomputed from
# the config, so a checkpoint may hold them and they are read as nothing.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# Files next to the weights that make a checkpoint usable as a whole: tokenizer, chat template
# and generation settings. `save_hf_checkpoint(copy_files_from=...)` copies those present.
COPIED_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
_SHOWN = 8  # names listed in an error before "and N more"


class HFCheckpoint(NamedTuple):
    """A Hugging Face checkpoint loaded into the decoder.

    Attributes:
      graphdef: the `nnx.GraphDef` of the `tunelib.models.Decoder`.
      params: its parameters as a pure dict of `jax.Array` (as `nnx.to_pure_dict` gives),
        each placed with its sharding; `nnx.merge(graphdef, params)` is the model.
      config: the `DecoderConfig` read from `config.json`.
      hf_config: `config.json` as read, for its token ids and for `save_hf_checkpoint`.
    """

    graphdef: nnx.GraphDef
    params: PyTree[jax.Array]
    config: DecoderConfig
    hf_config: dict[str, Any]


class _Weight(NamedTuple):
    """One parameter and the Hugging Face tensors it is made of."""

    path: tuple[Any, ...]  # keys into the pure-dict params
    # One tensor per index of the leading `stacked` axes (layers when stacked, experts), in
    # row-major order; a single tensor when `stacked` is 0.
    hf_names: tuple[str, ...]
    stacked: int
    # Kernels are [..., in, out]; Hugging Face's are [..., out, in]: the last two axes swap.
    transpose: bool
    shape: tuple[int, ...]  # ours

    @property
    def hf_shape(self) -> tuple[int, ...]:
        shape = self.shape[self.stacked :]
        return (*shape[:-2], shape[-1], shape[-2]) if self.transpose else shape

    def tensor_index(self, flat: int) -> tuple[int, ...]:
        """The index into the leading axes of the `flat`-th of `hf_names`."""
        return tuple(int(i) for i in np.unravel_index(flat, self.shape[: self.stacked]))


def abstract_params(config: DecoderConfig) -> tuple[nnx.GraphDef, PyTree[jax.ShapeDtypeStruct]]:
    """The decoder's graph definition and the shapes of its parameters, without allocating."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    return graphdef, nnx.to_pure_dict(state)


def weights_of(params: PyTree, config: DecoderConfig) -> list[_Weight]:
    """Every parameter with its Hugging Face tensor names (see `docs/models.md`)."""
    out = []
    # Layers of several shapes scanned by groups: `layers/<s>/...` stacks the layers of
    # `stacks[s]`, `[R_s, ...]` (`DecoderConfig.layer_stacks`).
    stacks = config.layer_stacks if config.scan_layers else ()
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(k.key for k in keypath)
        *modules, name = path
        # Qwen3-MoE saves one tensor per expert; Gemma 4 one `[E, out, in]` tensor per
        # projection, named without a suffix, as are its bare parameters (not a module's);
        # gpt-oss one `[E, in, out]` tensor per projection and its bias as `..._bias`.
        fused_experts = (config.parallel_moe or config.biased_experts) and "experts" in modules
        bare = fused_experts or _BARE.fullmatch("/".join(map(str, path))) is not None
        # Axes that index separate tensors, as (position in the module path, size).
        split = []
        if config.scan_layers and modules[0] == "layers":
            split.append((1, len(stacks[modules[1]]) if len(stacks) > 1 else len(stacks[0])))
        if "experts" in modules and not fused_experts:
            split.append((modules.index("experts") + 1, config.num_experts))
        module_paths = []
        for index in np.ndindex(*(size for _, size in split)):
            module = list(modules)
            for (position, _), i in sorted(zip(split, index, strict=True), reverse=True):
                module.insert(position, i)
            if len(stacks) > 1 and module[0] == "layers":  # [layers, r, s, ...]: one layer
                module[1:3] = [stacks[module[2]][module[1]]]
            module_paths.append(module)
        if bare:
            named = [(m if fused_experts else [*m, name]) for m in module_paths]
            hf_names = tuple(hf_module_name("/".join(map(str, (*m, "_")))) for m in named)
            if fused_experts and name == "bias":
                hf_names = tuple(f"{n}_bias" for n in hf_names)
        else:
            suffix = "bias" if name == "bias" else "weight"
            hf_names = tuple(
                f"{hf_module_name('/'.join(map(str, (*m, name))))}.{suffix}" for m in module_paths
            )
        transpose = name == "kernel" and not (fused_experts and config.biased_experts)
        out.append(_Weight(path, hf_names, len(split), transpose, tuple(leaf.shape)))
    return out


# Gemma 4's, gpt-oss's, DeepSeek-V3's and Qwen3.5's parameters that are not a module's
# weight: Hugging Face names them by their path.
_BARE = re.compile(
    r"layers/(\d+/)?(layer_scalar|router/scale|router/per_expert_scale|self_attn/sinks"
    r"|mlp/gate/e_score_correction_bias|linear_attn/A_log|linear_attn/dt_bias)"
)


def load_hf_checkpoint(
    directory: str | os.PathLike, options: LoadOptions | None = None, **keywords: Any
) -> HFCheckpoint:
    """Load a Hugging Face checkpoint of a supported family (`MODEL_TYPES`) into the decoder.

    `directory` holds `config.json` and the weights, either `model.safetensors` or the files
    that `model.safetensors.index.json` names. The config is read by `config_from_hf`; every
    tensor is accounted for before anything is read: a tensor the config does not imply, a
    missing one, or one of the wrong shape is an error that names it (the rotary `inv_freq`
    buffers old releases saved are skipped; with tied embeddings an `lm_head.weight` is
    accepted only if it equals the embedding). Each parameter is then created directly with
    its sharding by `jax.make_array_from_callback`, each device's shard read from the file
    alone (`safe_open(...).get_slice`), so no host copy of the whole model, nor of a whole
    sharded tensor, is ever built. Kernels are transposed from Hugging Face's `[out, in]`,
    and with `scan_layers` the layers' tensors are stacked on a leading axis. Weights are
    converted to `param_dtype` on the host (float32, bfloat16, float16 or float64 files).

    Args:
      directory: the checkpoint directory.
      options: how to load it (`LoadOptions`: the dtypes, `scan_layers`, `remat` and the
        placement, by `mesh` and `rules` or by `shardings`); None means its defaults.
      **keywords: fields of `LoadOptions` by name (`scan_layers=True`), replacing those of
        `options`.

    Returns:
      An `HFCheckpoint` `(graphdef, params, config, hf_config)`.

    Raises:
      FileNotFoundError: without `config.json` or safetensors weights.
      ValueError: naming the field or tensor, for an unsupported config, tensors missing,
        unexpected or of the wrong shape, a non-float tensor, or `shardings` that do not
        match the parameters.
      TypeError: for a keyword argument that is not a field of `LoadOptions`.

    Examples:
      Write a tiny checkpoint of our own and load it back sharded over 2 devices:

      >>> import tempfile, jax
      >>> from flax import nnx
      >>> from tunelib.formats import load_hf_checkpoint, save_hf_checkpoint
      >>> from tunelib.models import Decoder, DecoderConfig
      >>> config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
      ...                        num_hidden_layers=2, num_attention_heads=4,
      ...                        num_key_value_heads=2)
      >>> graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
      >>> directory = tempfile.mkdtemp() + "/llama"
      >>> _ = save_hf_checkpoint(directory, graphdef, params, model_type="llama")
      >>> mesh = jax.make_mesh((1, 2), ("data", "model"), devices=jax.devices()[:2])
      >>> loaded = load_hf_checkpoint(directory, mesh=mesh, scan_layers=True)
      >>> kernel = loaded.params["layers"]["mlp"]["up_proj"]["kernel"]
      >>> kernel.shape, kernel.sharding.spec
      ((2, 32, 64), P(None, None, 'model'))
      >>> bool((kernel[1] == params["layers"][1]["mlp"]["up_proj"]["kernel"][...]).all())
      True
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{directory} has no config.json.")
    hf_config = json.loads(config_path.read_text())
    options = LoadOptions.from_arguments(options, **keywords)
    with TensorFiles(directory) as files:
        return load_tensors(files, hf_config, options)


def load_tensors(
    files: TensorSource,
    hf_config: dict[str, Any],
    options: LoadOptions,
) -> HFCheckpoint:
    """The decoder of `hf_config` with its parameters read from `files` (Hugging Face names
    and layouts: `TensorFiles` for safetensors, or a GGUF file's dequantised tensors), each
    created with its sharding (see `load_hf_checkpoint`)."""
    config = config_from_hf(
        hf_config,
        dtype=options.dtype,
        param_dtype=options.param_dtype,
        scan_layers=options.scan_layers,
        remat=options.remat,
    )
    graphdef, abstract = abstract_params(config)
    mesh, shardings = options.mesh, options.shardings
    if shardings is not None and mesh is not None:
        raise ValueError("pass mesh or shardings, not both.")
    if shardings is None:
        if mesh is None:
            device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            shardings = jax.tree.map(lambda _: device, abstract)
        else:
            shardings = param_shardings(graphdef, abstract, mesh, options.rules)
    if jax.tree.structure(shardings) != jax.tree.structure(abstract):
        raise ValueError(
            "shardings must have the structure of the parameters: "
            f"{jax.tree.structure(abstract)}, got {jax.tree.structure(shardings)}."
        )
    weights = weights_of(abstract, config)
    target = np.dtype(jnp.dtype(options.param_dtype))
    _check_tensors(files, weights, config)
    leaves = [
        jax.make_array_from_callback(w.shape, sharding, _ShardReader(files, w, target))
        for w, sharding in zip(weights, jax.tree.leaves(shardings), strict=True)
    ]
    params = jax.tree.unflatten(jax.tree.structure(abstract), leaves)
    return HFCheckpoint(graphdef, params, config, hf_config)


class _ShardReader:
    """The `make_array_from_callback` callback of one parameter: its shard at `index`."""

    def __init__(self, files: TensorSource, weight: _Weight, dtype: np.dtype):
        self.files, self.weight, self.dtype = files, weight, dtype
        self.done: dict[tuple, np.ndarray] = {}  # replicated shards are read once

    def __call__(self, index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in self.done:
            w = self.weight
            if w.stacked:
                lead = w.shape[: w.stacked]
                picked = [range(n)[i] for n, i in zip(lead, index, strict=False)]
                tensors = [
                    self._read(w.hf_names[int(np.ravel_multi_index(i, lead))], index[w.stacked :])
                    for i in itertools.product(*picked)
                ]
                shard = np.stack(tensors).reshape(*map(len, picked), *tensors[0].shape)
            else:
                shard = self._read(w.hf_names[0], index)
            self.done[key] = shard
        return self.done[key]

    def _read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if self.weight.transpose:
            swapped = (*index[:-2], index[-1], index[-2])
            block = np.swapaxes(self.files.read(name, swapped), -1, -2)
            return np.ascontiguousarray(block.astype(self.dtype))
        return self.files.read(name, index).astype(self.dtype)


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _check_tensors(files: TensorSource, weights: list[_Weight], config: DecoderConfig) -> None:
    """Raise naming every tensor that is missing or unexpected, or the first of a wrong shape."""
    expected = {name: w.hf_shape for w in weights for name in w.hf_names}
    present = files.names()
    ignored = {name for name in present if _IGNORED.fullmatch(name)}
    if config.tie_word_embeddings and "lm_head.weight" in present:
        _check_tied(files)
        ignored.add("lm_head.weight")
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected) - ignored)
    if missing or unexpected:
        parts = [f"missing tensors {_listed(missing)}"] if missing else []
        parts += [f"unexpected tensors {_listed(unexpected)}"] if unexpected else []
        raise ValueError(
            f"the checkpoint in {files.directory} does not match its config: "
            + "; ".join(parts)
            + "."
        )
    for name, shape in expected.items():
        actual = files.shape(name)
        if actual != shape:
            raise ValueError(
                f"tensor {name!r} in {files.file_of[name]} has shape {list(actual)}, but "
                f"the config implies {list(shape)}."
            )
        code = files.dtype_code(name)
        if code not in FLOAT_DTYPES:
            raise ValueError(
                f"tensor {name!r} in {files.file_of[name]} has dtype {code}; only "
                f"{sorted(FLOAT_DTYPES)} weights are supported."
            )


def _check_tied(files: TensorSource) -> None:
    """With tied embeddings, a saved `lm_head.weight` must equal the embedding."""
    head, embedding = "lm_head.weight", "model.embed_tokens.weight"
    if embedding not in files.names() or files.shape(head) != files.shape(embedding):
        raise ValueError(
            f"config.json ties the embeddings, but the checkpoint's {head!r} does not match "
            f"{embedding!r}."
        )
    rows, width = files.shape(head)
    step = max(1, 2**22 // max(width, 1))
    for start in range(0, rows, step):
        block = (slice(start, min(start + step, rows)), slice(0, width))
        if not np.array_equal(files.read(head, block), files.read(embedding, block)):
            raise ValueError(
                f"config.json ties the embeddings, but {head!r} differs from {embedding!r} "
                f"(from row {start}); set tie_word_embeddings to false to load both."
            )


def save_hf_checkpoint(
    directory: str | os.PathLike,
    graphdef: nnx.GraphDef,
    params: PyTree,
    *,
    model_type: str | None = None,
    hf_config: Mapping[str, Any] | None = None,
    dtype: str | None = None,
    max_shard_size: int = 5 * 10**9,
    overwrite: bool = False,
    copy_files_from: str | os.PathLike | None = None,
    tokenizer: Any = None,
) -> Path:
    """Save the decoder as a Hugging Face checkpoint that `transformers` loads.

    Writes `config.json` (`config_to_hf`) and the weights under their Hugging
    Face names, kernels transposed to `[out, in]` and stacked layers split: one
    `model.safetensors`, or, above `max_shard_size` bytes, `model-00001-of-0000N.safetensors`
    files and `model.safetensors.index.json` (`metadata.total_size` and `weight_map`). With
    tied embeddings no `lm_head.weight` is written. Everything is written into a temporary
    directory beside `directory` and renamed into place at the end, so an interrupted save
    never leaves a checkpoint that looks complete. Loading the result with
    `load_hf_checkpoint` (same `param_dtype`) gives the parameters back bit for bit.

    Args:
      directory: where the checkpoint goes; it must not exist unless `overwrite`.
      graphdef: the `nnx.GraphDef` of a `tunelib.models.Decoder`.
      params: its parameters, an `nnx.State` or a pure dict, on any devices (each tensor is
        fetched to the host when its file is written). Merge LoRA adapters first. In a run
        of several processes every process calls this, as with Orbax: tensors spread over
        processes are gathered (`process_allgather`), process 0 writes, and every call
        returns once the checkpoint is complete.
      model_type: one of `MODEL_TYPES` ("llama", "qwen3", "gpt_oss", ...); None means
        `hf_config`'s.
      hf_config: the `config.json` the model was loaded from (`HFCheckpoint.hf_config`):
        its token ids and other metadata are kept, architectural fields rewritten.
      dtype: the dtype the weights are saved in; None means the config's `param_dtype`.
      max_shard_size: the most bytes of tensors in one file (a larger tensor gets a file of
        its own); the default is `transformers`' 5 GB.
      overwrite: replace an existing `directory` (only once the new one is complete).
      copy_files_from: a directory whose tokenizer, chat-template and generation files
        (`COPIED_FILES`, those present) are copied in, so the result is complete.
      tokenizer: a tokenizer with a `save(directory)` method (`tunelib.data.HFTokenizer`,
        from a GGUF file for instance) whose files are written in, after those copied.

    Returns:
      The checkpoint directory.

    Raises:
      FileExistsError: if `directory` exists and not `overwrite`.
      ValueError: if `params` are not the parameters of `graphdef`'s config, or `model_type`
        cannot express the config.

    Examples:
      >>> import json, os, tempfile
      >>> from flax import nnx
      >>> from tunelib.formats import save_hf_checkpoint
      >>> from tunelib.models import Decoder, DecoderConfig
      >>> config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
      ...                        num_hidden_layers=2, num_attention_heads=4,
      ...                        use_qk_norm=True, tie_word_embeddings=True)
      >>> graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
      >>> out = save_hf_checkpoint(tempfile.mkdtemp() + "/qwen3", graphdef, params,
      ...                          model_type="qwen3", dtype="bfloat16", max_shard_size=20_000)
      >>> for name in sorted(os.listdir(out)):
      ...     print(name)
      config.json
      model-00001-of-00003.safetensors
      model-00002-of-00003.safetensors
      model-00003-of-00003.safetensors
      model.safetensors.index.json
      >>> json.loads((out / "config.json").read_text())["architectures"]
      ['Qwen3ForCausalLM']
    """
    directory = Path(directory)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    if not all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(params)):
        # Spread over processes: every process calls this, so each gathers every tensor.
        params = multihost_utils.process_allgather(params, tiled=True)
    config = checked_config(graphdef, params)
    model_type = model_type or (hf_config or {}).get("model_type")
    if model_type is None:
        raise ValueError("model_type is None and hf_config has none: name the model family.")
    hf = config_to_hf(config, model_type=model_type, base=hf_config, dtype=dtype)
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be >= 1 byte, got {max_shard_size}.")
    if directory.exists() and not overwrite:
        raise FileExistsError(f"{directory} exists; pass overwrite=True to replace it.")
    target = np.dtype(jnp.dtype(hf["dtype"]))
    if jax.process_count() > 1:  # every process has checked before the folder appears
        multihost_utils.sync_global_devices(f"tunelib.save_hf_checkpoint {directory} checked")
    if jax.process_index() == 0:  # one writer; in a run of several, the others wait for it
        tensors = sorted(
            tensors_to_write(params, config, target), key=lambda t: tensor_order(t.name)
        )
        write_checkpoint(
            directory, tensors, hf, max_shard_size=max_shard_size,
            copy_files_from=copy_files_from, tokenizer=tokenizer,
        )  # fmt: skip
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"tunelib.save_hf_checkpoint {directory}")
    return directory


def checked_config(graphdef: nnx.GraphDef, params: PyTree) -> DecoderConfig:
    """The decoder's config, once `params` are known to be its parameters, all on this
    process (what a saved file needs)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    config = getattr(nnx.merge(graphdef, shapes), "config", None)
    if not isinstance(config, DecoderConfig):
        raise TypeError("graphdef must be the nnx.GraphDef of a tunelib.models.Decoder.")
    _, abstract = abstract_params(config)
    got = {w.path: w.shape for w in weights_of(params, config)}
    for w in weights_of(abstract, config):
        if got.get(w.path) != w.shape:
            name = "/".join(map(str, w.path))
            raise ValueError(f"params[{name!r}] has shape {got.get(w.path)}, expected {w.shape}.")
    if not all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(params)):
        raise ValueError(
            "params are spread over several processes; gather them into one (for example "
            "with jax.experimental.multihost_utils.process_allgather) and save from it."
        )
    return config


def write_checkpoint(
    directory: Path,
    tensors: Sequence[TensorToWrite],
    hf_config: Mapping[str, Any],
    *,
    max_shard_size: int,
    copy_files_from: str | os.PathLike | None = None,
    tokenizer: Any = None,
) -> Path:
    """Write a checkpoint folder whole or not at all: the tensors (one shard on the host at a
    time), `config.json`, the files copied from `copy_files_from` and `tokenizer`'s go into a
    temporary folder beside `directory`, which replaces `directory` (if any) only once
    complete."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = directory.parent / f".{directory.name}.{uuid.uuid4().hex[:8]}.partial"
    partial.mkdir()
    try:
        write_tensors(partial, tensors, max_shard_size=max_shard_size)
        text = json.dumps(hf_config, indent=2, sort_keys=True) + "\n"
        (partial / "config.json").write_text(text)
        if copy_files_from is not None:
            for name in COPIED_FILES:
                if (Path(copy_files_from) / name).is_file():
                    shutil.copyfile(Path(copy_files_from) / name, partial / name)
        if tokenizer is not None:
            tokenizer.save(partial)
        _fsync(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if directory.exists():
        old = partial.with_suffix(".old")
        directory.rename(old)
        partial.rename(directory)
        shutil.rmtree(old)
    else:
        partial.rename(directory)
    return directory


def tensors_to_write(params: PyTree, config: DecoderConfig, dtype: np.dtype):
    leaves = dict(zip(_paths(params), jax.tree.leaves(params), strict=True))
    for w in weights_of(params, config):
        array = leaves[w.path]
        for flat, name in enumerate(w.hf_names):
            index = w.tensor_index(flat)

            def fetch(array=array, index=index, w=w):
                host = np.asarray(jax.device_get(array[index]))
                return (np.swapaxes(host, -1, -2) if w.transpose else host).astype(dtype)

            yield TensorToWrite(name, w.hf_shape, dtype, fetch)


def _paths(params: PyTree) -> list[tuple[Any, ...]]:
    return [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def tensor_order(name: str) -> tuple:
    """Hugging Face's order: embedding, layers in index order, final norm, lm_head."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if match:
        return (1, int(match.group(1)), name)
    return (0 if "embed_tokens" in name else 2 if name.startswith("model.") else 3, 0, name)


def _fsync(directory: Path) -> None:
    """Flush the files of `directory` and the directory itself to disk."""
    for path in directory.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
