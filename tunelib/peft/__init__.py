"""Parameter-efficient fine-tuning: LoRA adapters on any JAX function, quantised base weights.

Select weights with `LoraRule`s (regular expressions over parameter paths), create adapters
with `init_lora` (their own pytree; `lora_labels` drives `optax.partition`), and run any model
function through `lora(fn)` on `apply_lora(params, adapters)`: matrix products compute
$xW + s\\,(xA)B$ without forming $W + s\\,AB$, and products with quantised base weights
(`quantize_params`: NF4 as in QLoRA and bitsandbytes, or int8; `gguf_base`: a GGUF model's
Q8_0 / Q4_0 / Q4_1 blocks as the file stores them) dequantise per layer under a custom VJP.
`merge_lora` folds adapters in for export; `save_adapters` / `restore_adapters` (Orbax) and
`export_peft` / `import_peft` (the Hugging Face PEFT format) store them.

Importing this package changes no global state: the two rules it adds to Quax (custom VJPs and
remat regions) are installed by the first call of a `lora(fn)`-wrapped function.
"""

from tunelib._deprecation import moved_names
from tunelib.peft._adapters import LoraAdapter, init_lora, merge_lora, unmerge_lora
from tunelib.peft._export import export_peft, import_peft, restore_adapters, save_adapters
from tunelib.peft._gguf_blocks import (
    GGML_TYPES,
    GGMLTensor,
    ggml_from_bytes,
    ggml_quantize,
    gguf_base,
)
from tunelib.peft._int8 import Int8Tensor, int8_quantize
from tunelib.peft._labels import lora_labels, lora_mask
from tunelib.peft._nf4 import (
    DYNAMIC_MAP,
    NF4_VALUES,
    NF4Tensor,
    bits_per_parameter,
    nf4_quantize,
    pack_nibbles,
    signed_dynamic_map,
    stored_bytes,
    table_lookup,
    unpack_nibbles,
)
from tunelib.peft._quantized import QUANT_FORMATS, dequantize_params, quantize_params
from tunelib.peft._rules import LoraRule, UnmatchedRuleWarning
from tunelib.peft._weights import LoraWeight, MaterializationWarning, apply_lora, lora

__all__ = [
    "DYNAMIC_MAP",
    "GGML_TYPES",
    "NF4_VALUES",
    "QUANT_FORMATS",
    "GGMLTensor",
    "Int8Tensor",
    "LoraAdapter",
    "LoraRule",
    "LoraWeight",
    "MaterializationWarning",
    "NF4Tensor",
    "UnmatchedRuleWarning",
    "apply_lora",
    "bits_per_parameter",
    "dequantize_params",
    "export_peft",
    "ggml_from_bytes",
    "ggml_quantize",
    "gguf_base",
    "import_peft",
    "init_lora",
    "int8_quantize",
    "lora",
    "lora_labels",
    "lora_mask",
    "merge_lora",
    "nf4_quantize",
    "pack_nibbles",
    "quantize_params",
    "restore_adapters",
    "save_adapters",
    "signed_dynamic_map",
    "stored_bytes",
    "table_lookup",
    "unmerge_lora",
    "unpack_nibbles",
]

__getattr__ = moved_names(__name__, {"decoder_module_name": ("tunelib.models", "hf_module_name")})
