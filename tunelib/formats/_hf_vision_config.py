"""How the `vision_config` of a Hugging Face vision-language checkpoint maps onto an encoder's
config (Gemma 4's `VisionConfig`, Qwen3.5's `QwenVisionConfig`): the same field names, an
axial RoPE, transformers' defaults as the config's, and every other key named."""

import dataclasses
from collections.abc import Mapping
from typing import Any

# The keys every transformers config carries, none of which changes the encoder's outputs.
GENERIC_FIELDS = frozenset(
    {
        "model_type",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "architectures",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
        "_name_or_path",
        "tie_word_embeddings",
        "_attn_implementation_autoset",
    }
)
# The encoder config's fields that a `vision_config` does not hold under their own name.
_NOT_READ = ("rope_theta", "dtype", "param_dtype")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfigFields:
    """One family's `vision_config`: transformers' field of each name is `config_class`'s
    field of that name (their defaults agree), but `rope_theta`, which `rope_parameters`
    holds (an axial RoPE, `{"rope_type": "axial", "rope_theta": ...}`), and the dtypes,
    which are ours to choose. `checked` are the fields the family's reader checks or,
    like transformers, ignores; any other key is unknown.

    Attributes:
      family: the family's name in error messages ("Gemma 4").
      model_type: the `model_type` transformers writes in the `vision_config`.
      config_class: the encoder's config dataclass.
      checked: the fields read by the family's own code, or refused.
    """

    family: str
    model_type: str
    config_class: type
    checked: tuple[str, ...] = ()

    @property
    def read(self) -> tuple[str, ...]:
        """The fields read into `config_class`'s field of the same name."""
        names = (f.name for f in dataclasses.fields(self.config_class))
        return tuple(name for name in names if name not in _NOT_READ)

    @property
    def named(self) -> frozenset[str]:
        """Every field of transformers' config class: those read, `rope_parameters` and
        `checked`."""
        return frozenset({*self.read, "rope_parameters", *self.checked})

    def unknown(self, hf: Mapping[str, Any]) -> list[str]:
        """The keys of a `vision_config` dict that are neither named nor generic."""
        return sorted(set(hf) - self.named - GENERIC_FIELDS)

    def from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """The `config_class` fields (all but the dtypes) of a `vision_config` dict, each
        field left out at its default; a `ValueError` for a RoPE other than axial."""
        if not isinstance(hf, Mapping):
            raise TypeError(f"vision_config must be a dict, got {type(hf).__name__}.")
        defaults = {f.name: f.default for f in dataclasses.fields(self.config_class)}
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(
                f"config.json: vision_config.rope_parameters.rope_type is "
                f"{rope['rope_type']!r}; {self.family}'s vision encoder supports only 'axial'."
            )
        return {
            **{name: hf.get(name, defaults[name]) for name in self.read},
            "rope_theta": rope.get("rope_theta", defaults["rope_theta"]),
        }

    def to_hf(self, config: Any) -> dict[str, Any]:
        """The `vision_config` dict of a `config_class` config, as transformers writes it
        (without the family's checked fields)."""
        return {
            "model_type": self.model_type,
            **{name: getattr(config, name) for name in self.read},
            "rope_parameters": {"rope_type": "axial", "rope_theta": config.rope_theta},
        }
