"""Adapters on disk: Orbax checkpoints of their own, and the Hugging Face PEFT format (written
and read by `tunelib.formats`; here, the mapping between a model's adapters and PEFT's
modules)."""

import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jaxtyping import PyTree

from tunelib.formats import read_peft_lora, write_peft_lora
from tunelib.models import hf_module_name
from tunelib.peft._adapters import LoraAdapter, adapter_leaves, check_adapters, set_nested
from tunelib.peft._rules import array_keys, array_leaves, keyed_leaves

# ----------------------------------------------------------------------------- Orbax


def save_adapters(directory: str | os.PathLike, adapters: PyTree) -> None:
    """Save adapters alone (arrays and metadata) as an Orbax checkpoint at `directory`.

    Orbax writes into a temporary folder and renames it into place when complete, so a crash
    mid-save never leaves a partial checkpoint under `directory`; an existing one is replaced
    only by a complete new one.

    Examples:
      >>> import tempfile, jax.numpy as jnp
      >>> from tunelib import peft
      >>> adapters = {"w": peft.LoraAdapter(a=jnp.ones((3, 1)), b=jnp.zeros((1, 2)), alpha=4.0)}
      >>> folder = tempfile.mkdtemp() + "/adapters"
      >>> peft.save_adapters(folder, adapters)
      >>> restored = peft.restore_adapters(folder)
      >>> print(restored["w"].alpha, restored["w"].a.shape)
      4.0 (3, 1)
    """
    found = adapter_leaves(adapters)
    keys = keyed_leaves(adapters, is_leaf=lambda x: isinstance(x, LoraAdapter))
    metadata = {
        "format": "tunelib.peft.adapters/1",
        "adapters": [
            {
                "keys": list(keys[path][0]),
                "a": {"shape": list(a.a.shape), "dtype": jnp.dtype(a.a.dtype).name},
                "b": {"shape": list(a.b.shape), "dtype": jnp.dtype(a.b.dtype).name},
                "alpha": a.alpha,
                "rslora": a.rslora,
                "dropout": a.dropout,
                "layout": a.layout,
            }
            for path, a in found.items()
        ],
    }
    arrays = {str(i): {"a": a.a, "b": a.b} for i, a in enumerate(found.values())}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(
            Path(directory).resolve(),
            args=ocp.args.Composite(
                arrays=ocp.args.StandardSave(arrays), metadata=ocp.args.JsonSave(metadata)
            ),
            force=True,
        )


def restore_adapters(directory: str | os.PathLike) -> dict:
    """Adapters saved by `save_adapters`, rebuilt with their nesting and metadata."""
    directory = Path(directory).resolve()
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        metadata = checkpointer.restore(
            directory, args=ocp.args.Composite(metadata=ocp.args.JsonRestore())
        )["metadata"]
        if metadata.get("format") != "tunelib.peft.adapters/1":
            raise ValueError(f"{directory} does not hold adapters saved by save_adapters.")
        template = {
            str(i): {
                part: jax.ShapeDtypeStruct(tuple(entry[part]["shape"]), entry[part]["dtype"])
                for part in ("a", "b")
            }
            for i, entry in enumerate(metadata["adapters"])
        }
        arrays = checkpointer.restore(
            directory, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(template))
        )["arrays"]
    out: dict = {}
    for i, entry in enumerate(metadata["adapters"]):
        adapter = LoraAdapter(
            a=arrays[str(i)]["a"],
            b=arrays[str(i)]["b"],
            alpha=entry["alpha"],
            rslora=entry["rslora"],
            dropout=entry["dropout"],
            layout=entry["layout"],
        )
        set_nested(out, tuple(entry["keys"]), adapter)
    return out


# ----------------------------------------------------------------------------- PEFT


def _modules(
    path: str,
    shape: tuple[int, ...],
    module_name: Callable[[str], str],
    layer_stacks: Sequence[Sequence[int]] | None = None,
) -> list[str]:
    """The module names of a weight `[..., in, out]`, one per index of its leading axes, in
    row-major order: a stacked `[L, ...]` weight gets the layer index after the path's first
    key (where `nnx.scan` stacks it), and stacked experts (`.../experts/<name>/kernel`,
    `[E, ...]` or `[L, E, ...]`) the expert index after "experts", as PEFT named each
    expert's module in the per-expert layout. A stack of layers scanned by groups,
    `layers/<s>/...` `[R_s, ...]`, holds the layers `layer_stacks[s]`."""
    keys = path.split("/")
    lead = shape[:-2]
    positions = [keys.index("experts") + 1] if "experts" in keys else []
    grouped = False
    if len(lead) > len(positions):
        grouped = len(keys) > 1 and keys[1].isdigit()
        if grouped and layer_stacks is None:
            raise ValueError(
                f"{path!r} stacks layers scanned by groups, which its path does not name: "
                "give layer_stacks (DecoderConfig.layer_stacks)."
            )
        positions.insert(0, 1)
    if len(shape) < 2 or len(lead) != len(positions):
        raise ValueError(
            f"{path!r} has shape {shape}; only a layer axis and an expert axis can be exported."
        )
    names = []
    for index in np.ndindex(*lead):
        named = list(keys)
        for position, i in sorted(zip(positions, index, strict=True), reverse=True):
            named.insert(position, str(i))
        if grouped:  # layers, r, s, ...: the stack's r-th layer
            named[1:3] = [str(layer_stacks[int(named[2])][int(named[1])])]
        names.append(module_name("/".join(named)))
    return names


def _fused_expert_weights(paths: Iterable[str]) -> set[str]:
    """The weights of fused experts (an `experts` module holding a `gate_up_proj`: Gemma 4's
    and gpt-oss's), which PEFT adapts as parameters, not as per-expert modules."""
    paths = list(paths)
    fused = {p.split("/experts/")[0] for p in paths if "/experts/gate_up_proj/" in p}
    return {p for p in paths if "/experts/" in p and p.split("/experts/")[0] in fused}


def _factors(adapter: LoraAdapter) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's `lora_A.weight [..., r, in]` and `lora_B.weight [..., out, r]`."""
    a, b = np.asarray(adapter.a), np.asarray(adapter.b)
    if adapter.layout == "in_out":  # delta [in, out] = A B, so delta^T = B^T A^T
        return np.swapaxes(a, -1, -2), np.swapaxes(b, -1, -2)
    return b, a  # delta [out, in] = A B: PEFT's B is our A


def export_peft(
    directory: str | os.PathLike,
    adapters: PyTree,
    params: PyTree,
    *,
    module_name: Callable[[str], str] = hf_module_name,
    base_model_name_or_path: str | None = None,
    layer_stacks: Sequence[Sequence[int]] | None = None,
) -> None:
    """Write adapters in the Hugging Face PEFT format: `adapter_config.json` and
    `adapter_model.safetensors`.

    Tensors are named `base_model.model.<module>.lora_A.weight` (`[r, in]`) and
    `...lora_B.weight` (`[out, r]`), the layout of `peft.LoraModel`; a stacked adapter
    `[L, ...]` is written per layer, and stacked experts per expert
    (`model.layers.0.mlp.experts.3.gate_proj`, the per-expert module layout). The config
    holds `r` and `lora_alpha` (the most common among the adapters, with `rank_pattern` /
    `alpha_pattern` for the others), `use_rslora`,
    `lora_dropout`, and `target_modules`: the list of module suffixes when every module of
    the base with those suffixes is adapted, else a regular expression of exactly the
    adapted modules. The directory is written by `tunelib.formats.write_peft_lora`: in full
    next to `directory` and renamed into place, so a crash never leaves a partial export.

    Args:
      directory: the output directory (replaced if it exists).
      adapters: the adapters to export (float32 or float16; other dtypes as float32).
      params: the base parameters they belong to (for shapes and the module list).
      module_name: maps an unstacked `/`-joined weight path to its Hugging Face module name;
        the default is `tunelib.models.hf_module_name`, for `tunelib.models.Decoder`.
      base_model_name_or_path: recorded in the config for `peft.PeftModel.from_pretrained`.
      layer_stacks: for a model whose layers are scanned by groups, the layers each stack
        `layers/<s>/...` holds (`DecoderConfig.layer_stacks`); without it such a stack is
        refused, since its path does not name its layers. Other models ignore it.
    """
    found = check_adapters(params, adapters)
    if not found:
        raise ValueError("adapters holds no LoraAdapter to export.")
    fused = sorted(set(found) & _fused_expert_weights(array_leaves(params)))
    if fused:
        raise ValueError(
            f"{fused[0]!r} is a fused expert weight (Gemma 4, gpt-oss); PEFT adapts those as "
            "parameters (target_parameters), a layout tunelib does not write. Merge these "
            "adapters into the weights (tunelib.peft.merge_lora) or leave the experts out of "
            "the LoRA rules to export the rest."
        )
    if len({a.rslora for a in found.values()}) > 1:
        raise ValueError("PEFT has one use_rslora for all adapters; these mix both.")
    factors: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    ranks, alphas, dropouts = {}, {}, Counter()
    for path, adapter in found.items():
        lora_a, lora_b = _factors(adapter)
        shape = (*adapter.a.shape[:-1], adapter.b.shape[-1])
        names = _modules(path, shape, module_name, layer_stacks)
        parts = zip(
            names,
            lora_a.reshape(-1, *lora_a.shape[-2:]),
            lora_b.reshape(-1, *lora_b.shape[-2:]),
            strict=True,
        )
        for name, part_a, part_b in parts:
            factors[name] = (part_a, part_b)
            ranks[name], alphas[name] = adapter.rank, adapter.alpha
        dropouts[adapter.dropout] += 1
    r = Counter(ranks.values()).most_common(1)[0][0]
    alpha = Counter(alphas.values()).most_common(1)[0][0]
    config = {
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropouts.most_common(1)[0][0],
        "use_rslora": next(iter(found.values())).rslora,
        "target_modules": _target_modules(set(ranks), params, module_name, layer_stacks),
        "rank_pattern": {re.escape(n): k for n, k in ranks.items() if k != r},
        "alpha_pattern": {re.escape(n): k for n, k in alphas.items() if k != alpha},
    }
    write_peft_lora(directory, factors, config)


def _target_modules(
    adapted: set[str], params: PyTree, module_name, layer_stacks
) -> list[str] | str:
    weights = array_leaves(params)
    fused = _fused_expert_weights(weights)
    every = []
    for path, leaf in weights.items():
        if 2 <= len(leaf.shape) <= 4 and path not in fused:
            try:
                every += _modules(path, tuple(leaf.shape), module_name, layer_stacks)
            except ValueError:  # not a product's weight (a convolution's `[C, 1, K]`): never
                continue  # adapted (the adapted ones were named above), so not a target
    suffixes = sorted({name.rsplit(".", 1)[-1] for name in adapted})
    covered = {name for name in every if name.rsplit(".", 1)[-1] in suffixes}
    if covered == adapted:
        return suffixes
    return "|".join(re.escape(name) for name in sorted(adapted))


def _pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    """PEFT's lookup: the first key matching the end of the module name at a dot boundary."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def import_peft(
    directory: str | os.PathLike,
    params: PyTree,
    *,
    module_name: Callable[[str], str] = hf_module_name,
    layout: str = "in_out",
    layer_stacks: Sequence[Sequence[int]] | None = None,
) -> dict:
    """Adapters read from a Hugging Face PEFT LoRA directory, for the weights of `params`.

    The inverse of `export_peft`: every `lora_A` / `lora_B` pair that
    `tunelib.formats.read_peft_lora` reads is matched to the weight of
    `params` whose module name it carries, transposed into `[in, r]` / `[r, out]` factors
    (for `layout="in_out"` weights) and stacked where `params` stacks layers (layers the
    file has no adapter for get zero factors, which change nothing). `r`, `lora_alpha`,
    `rank_pattern`, `alpha_pattern` and `use_rslora` give each adapter's scale. A tensor for
    a module `params` does not have, a factor without its partner, or a shape that does not
    fit is an error naming it.

    Args:
      directory: a directory with `adapter_config.json` and `adapter_model.safetensors`.
      params: the base parameters the adapters are for.
      module_name: as in `export_peft`.
      layout: how the weights of `params` are applied, as in `LoraRule`.
      layer_stacks: as in `export_peft`, for a model whose layers are scanned by groups.

    Returns:
      A nested dict of `LoraAdapter`s keyed like `params` (as `init_lora` returns).
    """
    config, factors = read_peft_lora(directory)
    weights = array_leaves(params)
    where = {}  # module name -> (weight path, flat index over its leading axes)
    fused = _fused_expert_weights(weights)
    for path, leaf in weights.items():
        if 2 <= len(leaf.shape) <= 4 and path not in fused:
            names = _modules(path, tuple(leaf.shape), module_name, layer_stacks)
            for i, name in enumerate(names):
                where[name] = (path, i)
    unknown = sorted(set(factors) - set(where))
    if unknown:
        raise ValueError(f"{directory} has adapters for modules params lacks: {unknown}.")
    per_path: dict[str, dict[int, tuple[np.ndarray, np.ndarray, str]]] = {}
    for module, (lora_a, lora_b) in factors.items():
        path, layer = where[module]
        per_path.setdefault(path, {})[layer] = (lora_a, lora_b, module)
    keys = array_keys(params)
    out: dict = {}
    for path, layers in per_path.items():
        shape = tuple(weights[path].shape)
        ranks = {a.shape[0] for a, _, _ in layers.values()}
        alphas = {
            _pattern_value(config.get("alpha_pattern", {}), m, config["lora_alpha"])
            for _, _, m in layers.values()
        }
        if len(ranks) > 1 or len(alphas) > 1:
            raise ValueError(f"the layers of stacked {path!r} have different ranks or alphas.")
        r, alpha = ranks.pop(), alphas.pop()
        a_parts, b_parts = [], []
        for layer in range(math.prod(shape[:-2])):
            matrix = shape[-2:]
            if layer in layers:
                lora_a, lora_b, module = layers[layer]
                a, b = _ours(lora_a, lora_b, layout)
                if a.shape != (matrix[0], r) or b.shape != (r, matrix[1]):
                    raise ValueError(
                        f"the factors of {module!r} ({lora_a.shape}, {lora_b.shape}) do not fit "
                        f"its weight {path!r} of shape {matrix}."
                    )
            else:
                dtype = next(iter(layers.values()))[0].dtype
                a, b = np.zeros((matrix[0], r), dtype), np.zeros((r, matrix[1]), dtype)
            a_parts.append(a)
            b_parts.append(b)
        a = np.stack(a_parts).reshape(*shape[:-2], *a_parts[0].shape)
        b = np.stack(b_parts).reshape(*shape[:-2], *b_parts[0].shape)
        adapter = LoraAdapter(
            a=jnp.asarray(a),
            b=jnp.asarray(b),
            alpha=float(alpha),
            rslora=bool(config.get("use_rslora", False)),
            dropout=float(config.get("lora_dropout", 0.0)),
            layout=layout,
        )
        set_nested(out, keys[path], adapter)
    return out


def _ours(lora_a: np.ndarray, lora_b: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray]:
    if layout == "in_out":
        return lora_a.T, lora_b.T
    return lora_b, lora_a
