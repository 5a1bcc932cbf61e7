"""The configuration of Gemma 4's vision encoder, named after the fields of its `config.json`."""

import dataclasses

from tunelib.models._config import DTYPE_NAMES, HIDDEN_ACTS, Dtypes


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig(Dtypes):
    r"""Hyperparameters of Gemma 4's vision encoder (`vision_config` of a `gemma4` config).

    Fields named as in transformers' `Gemma4VisionConfig` mean what they mean there; every
    field is checked on construction (a `ValueError` or `TypeError` naming it).

    Attributes:
      hidden_size: $C$, width of the encoder's residual stream.
      intermediate_size: width of its gated MLPs.
      num_hidden_layers: encoder layers.
      num_attention_heads: query heads.
      num_key_value_heads: key/value heads (grouped-query attention).
      head_dim: $D$, width of one head; a multiple of 4 (two axes of rotary pairs).
      hidden_activation: the MLP's gate activation, "gelu_pytorch_tanh" or "silu".
      rms_norm_eps: $\epsilon$ of every RMSNorm (and of the multimodal embedder's).
      rope_theta: base $\theta$ of the axial 2-D rotary frequencies.
      pooling_kernel_size: $k$; $k \times k$ patches are averaged into one soft token.
      patch_size: $p$, the side of a square patch in pixels.
      position_embedding_size: rows of each axis' learned position table.
      use_clipped_linears: clamp every projection's input and output to bounds stored in
        the checkpoint (infinite when it holds none).
      standardize: subtract a learned bias from the pooled features and multiply by a
        learned scale.
      initializer_range: standard deviation of the initial weights.
      dtype: the compute dtype.
      param_dtype: the dtype the weights are stored in.
    """

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    initializer_range: float = 0.02
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "pooling_kernel_size",
            "patch_size",
            "position_embedding_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}.")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.head_dim % 4:
            raise ValueError(
                f"head_dim must be a multiple of 4 (a rotary pair per channel pair on each of "
                f"two axes), got {self.head_dim}."
            )
        if self.hidden_activation not in HIDDEN_ACTS:
            raise ValueError(
                f"hidden_activation must be one of {HIDDEN_ACTS}, got {self.hidden_activation!r}."
            )
        for name in ("use_clipped_linears", "standardize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}.")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPE_NAMES:
                raise ValueError(
                    f"{name} must be one of {DTYPE_NAMES}, got {getattr(self, name)!r}."
                )

    # What the decoder's building blocks (`Dense`, `RMSNorm`) read from a config.
    norm_offset = False
