"""The configuration of Qwen3.5's vision encoder, named after the fields of its `config.json`."""

import dataclasses
import math

from tunelib.models._config import DTYPE_NAMES, HIDDEN_ACTS, Dtypes
from tunelib.models._deepseek_config import check_positive_float, check_positive_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class QwenVisionConfig(Dtypes):
    r"""Hyperparameters of Qwen3.5's vision encoder (`vision_config` of a `qwen3_5` config).

    Fields named as in transformers' `Qwen3_5VisionConfig` mean what they mean there
    (`depth` layers, `num_heads` heads); every field is checked on construction (a
    `ValueError` or `TypeError` naming it).

    Attributes:
      depth: encoder layers.
      hidden_size: $C$, width of the encoder's residual stream.
      hidden_act: the MLP's activation, "gelu_pytorch_tanh" or "silu".
      intermediate_size: width of its MLPs.
      num_heads: attention heads; `hidden_size // num_heads` wide, a multiple of 4 (two axes
        of rotary pairs).
      in_channels: image channels (3).
      patch_size: $p$, the side of a square patch in pixels.
      spatial_merge_size: $m$; $m \times m$ neighbouring patches merge into one token.
      temporal_patch_size: $T$, frames per patch (a still image is $T$ equal frames).
      out_hidden_size: width of the merged tokens: the language model's hidden size.
      num_position_embeddings: rows of the learned position table, a square $s \times s$
        grid resampled to each image's.
      initializer_range: standard deviation of the initial weights.
      rope_theta: base $\theta$ of the axial 2-D rotary frequencies.
      dtype: the compute dtype.
      param_dtype: the dtype the weights are stored in.
    """

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    initializer_range: float = 0.02
    rope_theta: float = 10000.0
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in (
            "depth",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "in_channels",
            "patch_size",
            "spatial_merge_size",
            "temporal_patch_size",
            "out_hidden_size",
            "num_position_embeddings",
        ):
            check_positive_int(getattr(self, name), name)
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be num_heads ({self.num_heads}) heads "
                "of a width that is a multiple of 4 (a rotary pair per channel pair on each of "
                "two axes)."
            )
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ValueError(
                f"num_position_embeddings must be a square (an s x s grid), got "
                f"{self.num_position_embeddings}."
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}.")
        for name in ("rope_theta", "initializer_range"):
            check_positive_float(getattr(self, name), name)
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPE_NAMES:
                raise ValueError(
                    f"{name} must be one of {DTYPE_NAMES}, got {getattr(self, name)!r}."
                )

    @property
    def head_dim(self) -> int:
        """The width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def patch_width(self) -> int:
        """The values of one patch: `in_channels * temporal_patch_size * patch_size**2`."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2
