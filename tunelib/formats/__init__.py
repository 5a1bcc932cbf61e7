"""File formats: Hugging Face checkpoints and safetensors, GGUF files and their tokenizers.

`load_hf_checkpoint` and `save_hf_checkpoint` read and write Hugging Face checkpoints
(`config.json` and safetensors, one file or sharded) of the Llama, Mistral, Qwen2, Qwen3,
Qwen3-MoE, Gemma 2, Gemma 3, Gemma 4 and gpt-oss families into and out of `tunelib.models.Decoder`;
`config_from_hf` and `config_to_hf` convert the config alone; `load_hf_vision_language` and
`save_hf_vision_language` do the same for Gemma 4's and Qwen3.5's vision-language checkpoints
(`tunelib.models.VisionLanguageModel`). `read_gguf`, `load_gguf`,
`convert_gguf` and `save_gguf` read, load, convert and write llama.cpp's GGUF files, and
`gguf_tokenizer` builds a file's tokenizer (`gguf_tokenizer_metadata` gives a tokenizer's
GGUF metadata back). Every loader takes one `LoadOptions` (dtypes, stacked layers, remat,
placement), its fields as keyword arguments, or both (a keyword argument replaces that
field). `write_peft_lora` and `read_peft_lora` write and read Hugging Face PEFT LoRA adapters
as factor matrices per module.
`tunelib.peft` builds on this package: `export_peft` / `import_peft` map a model's adapters to
PEFT's modules, and `gguf_base` keeps a GGUF file's quantised blocks as a QLoRA base.
"""

from tunelib.formats._gguf import (
    GGUF_ARCHITECTURES,
    GGUF_TENSOR_TYPES,
    GGUFModel,
    GGUFTensor,
    convert_gguf,
    gguf_raw_tensors,
    gguf_tensors,
    load_gguf,
    read_gguf,
)
from tunelib.formats._gguf_tokenizer import gguf_tokenizer, gguf_tokenizer_metadata
from tunelib.formats._gguf_writer import save_gguf
from tunelib.formats._hf_checkpoint import (
    COPIED_FILES,
    HFCheckpoint,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from tunelib.formats._hf_config import MODEL_TYPES, config_from_hf, config_to_hf
from tunelib.formats._hf_vision_language import (
    HFVisionLanguage,
    load_hf_vision_language,
    save_hf_vision_language,
)
from tunelib.formats._load_options import LoadOptions
from tunelib.formats._peft_lora import read_peft_lora, write_peft_lora

__all__ = [
    "COPIED_FILES",
    "GGUF_ARCHITECTURES",
    "GGUF_TENSOR_TYPES",
    "MODEL_TYPES",
    "GGUFModel",
    "GGUFTensor",
    "HFCheckpoint",
    "HFVisionLanguage",
    "LoadOptions",
    "config_from_hf",
    "config_to_hf",
    "convert_gguf",
    "gguf_raw_tensors",
    "gguf_tensors",
    "gguf_tokenizer",
    "gguf_tokenizer_metadata",
    "load_gguf",
    "load_hf_checkpoint",
    "load_hf_vision_language",
    "read_gguf",
    "read_peft_lora",
    "save_gguf",
    "save_hf_checkpoint",
    "save_hf_vision_language",
    "write_peft_lora",
]
