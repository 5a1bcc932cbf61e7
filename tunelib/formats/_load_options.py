"""How a checkpoint is loaded into the decoder: one set of options for every loader."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jaxtyping import PyTree

from tunelib.models import TENSOR_PARALLEL_RULES


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """The options of `load_hf_checkpoint`, `load_gguf` and `tunelib.peft.gguf_base`.

    Each loader takes either a `LoadOptions` (its second argument, `options`) or the same
    fields as keyword arguments, so one value describes how a model is loaded whatever its
    file format.

    Attributes:
      dtype: the compute dtype (see `DecoderConfig.dtype`).
      param_dtype: the dtype the parameters are created in.
      scan_layers: stack the layers (`DecoderConfig.scan_layers`).
      remat: rematerialise each layer in the backward pass.
      mesh: shard every parameter over this mesh by its logical axis names and `rules`
        (`tunelib.models.param_shardings`). None (and no `shardings`) puts every parameter
        on the default device.
      rules: the logical-name-to-mesh-axis rules used with `mesh`.
      shardings: instead of `mesh`, a pure dict of `jax.sharding.Sharding` with the
        structure of the parameters (not for `gguf_base`, which places by `mesh`).

    Examples:
      >>> from tunelib.formats import LoadOptions
      >>> options = LoadOptions(param_dtype="bfloat16", scan_layers=True)
      >>> options.dtype, options.param_dtype, options.scan_layers
      ('float32', 'bfloat16', True)
      >>> LoadOptions.from_arguments(None, scan_layers=True) == LoadOptions(scan_layers=True)
      True
      >>> LoadOptions.from_arguments(options, scan_layers=False) is options
      True
    """

    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = False
    remat: bool = False
    mesh: jax.sharding.Mesh | None = None
    rules: Sequence[tuple[str, str | None]] = TENSOR_PARALLEL_RULES
    shardings: PyTree[jax.sharding.Sharding] | None = None

    @classmethod
    def from_arguments(cls, options: "LoadOptions | None", **keywords: Any) -> "LoadOptions":
        """The options a loader was called with: `options`, or else its keyword arguments.

        Args:
          options: the `LoadOptions` passed, or None.
          **keywords: the loader's keyword arguments of the same names.

        Raises:
          TypeError: when `options` is given together with a keyword argument that differs
            from its default (the call would say two things).
        """
        if options is None:
            return cls(**keywords)
        if not isinstance(options, LoadOptions):
            raise TypeError(f"options must be a LoadOptions, got {type(options).__name__}.")
        defaults = cls()
        changed = sorted(
            name for name, value in keywords.items() if not _same(value, getattr(defaults, name))
        )
        if changed:
            raise TypeError(
                f"pass the load options either as options= or as keyword arguments, not both; "
                f"got options and {', '.join(changed)}."
            )
        return options


def _same(value: Any, default: Any) -> bool:
    """Whether a keyword argument is its default (defaults are None or plain values)."""
    if default is None or value is None:
        return value is default
    return type(value) is type(default) and value == default
