"""How a checkpoint is loaded into the decoder: one set of options for every loader."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jaxtyping import PyTree

from tunelib.models import TENSOR_PARALLEL_RULES


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """The options of `load_hf_checkpoint`, `load_gguf`, `load_hf_vision_language` and
    `tunelib.peft.gguf_base`.

    Each loader takes a `LoadOptions` as its second argument (`options`), its fields as
    keyword arguments, or both (a keyword argument then replaces that field of `options`):
    the options are declared here alone, and one value describes how a model is loaded
    whatever its file format.

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
      >>> LoadOptions.from_arguments(options, dtype="bfloat16").dtype
      'bfloat16'
      >>> LoadOptions.from_arguments(options) is options
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
        """The options a loader was called with: `options` (None: the defaults) with the
        fields its keyword arguments name replaced.

        Args:
          options: the `LoadOptions` passed, or None.
          **keywords: the loader's keyword arguments, each a field of `LoadOptions`.

        Raises:
          TypeError: when `options` is not a `LoadOptions`, or a keyword argument is not one
            of its fields (naming it and the fields).
        """
        if options is not None and not isinstance(options, LoadOptions):
            raise TypeError(f"options must be a LoadOptions, got {type(options).__name__}.")
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(keywords) - set(fields))
        if unknown:
            raise TypeError(
                f"unexpected keyword arguments {unknown}; the load options are {fields}."
            )
        if options is None:
            return cls(**keywords)
        return dataclasses.replace(options, **keywords) if keywords else options
