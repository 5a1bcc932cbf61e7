"""Data for post-training: tokenizers, records, chat templates, Grain pipelines and a task.

One stack serves every source. A `Tokenizer` (the built-in task's `CharTokenizer`, or a
checkpoint's `HFTokenizer` with its chat template; `load_tokenizer` reads either from a model
folder) encodes records in the usual Hugging Face shapes (chat `messages`,
prompt-completion, preference pairs, prompt-answer), read from JSON-lines, JSON or Parquet
files or built in Python, such as the arithmetic task's. `validate_records` checks them,
and `sft_dataset`, `preference_dataset` and `encode_prompts` turn them into fixed-shape
NumPy batches, padded or packed (several sequences per row, with `segment_ids` and
`positions`). Everything here runs on the host in Python and NumPy; a pipeline's iterator
state is a JSON-serialisable dict, so training resumes the identical stream from a
checkpoint.

Records with images (`{"images", "messages"}`) are checked image by image
(`read_image_records`), and Gemma 4's and Qwen3.5's image preprocessing
(`gemma4_image_inputs`, `qwen_vl_image_inputs`, `expand_image_tokens`) turns their images
into the vision encoder's patches and the prompt's soft tokens; the vision task
(`vision_counting_split`) draws its own pictures.
"""

from tunelib._deprecation import moved_names
from tunelib.data._arithmetic import (
    ANSWER_READINGS,
    OPERATIONS,
    arithmetic_split,
    last_number,
    preference_pairs,
    problem_in_words,
    verify_answer,
)
from tunelib.data._chat_template import (
    TemplateError,
    completion_spans,
    encode_chat,
    render_chat_template,
    tokens_in_spans,
)
from tunelib.data._gemma4_images import gemma4_image_inputs, gemma4_image_size
from tunelib.data._image_records import (
    IMAGE_REASONS,
    read_image_records,
    validate_image_records,
    write_image_records,
)
from tunelib.data._image_tokens import expand_image_tokens
from tunelib.data._images import IMAGE_MODES, ImageError, load_image
from tunelib.data._pipelines import encode_prompts, preference_dataset, sft_dataset
from tunelib.data._qwen_vl_images import qwen_vl_image_inputs, qwen_vl_image_size
from tunelib.data._records import (
    REASONS,
    RecordError,
    RecordReport,
    encode_records,
    read_records,
    validate_records,
)
from tunelib.data._tokenizers import (
    DEFAULT_ALPHABET,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)
from tunelib.data._vision_task import VISION_QUESTIONS, vision_counting_split

__all__ = [
    "ANSWER_READINGS",
    "DEFAULT_ALPHABET",
    "IMAGE_MODES",
    "IMAGE_REASONS",
    "OPERATIONS",
    "REASONS",
    "VISION_QUESTIONS",
    "CharTokenizer",
    "HFTokenizer",
    "ImageError",
    "RecordError",
    "RecordReport",
    "TemplateError",
    "Tokenizer",
    "arithmetic_split",
    "completion_spans",
    "encode_chat",
    "encode_prompts",
    "encode_records",
    "expand_image_tokens",
    "gemma4_image_inputs",
    "gemma4_image_size",
    "last_number",
    "load_image",
    "load_tokenizer",
    "preference_dataset",
    "preference_pairs",
    "problem_in_words",
    "qwen_vl_image_inputs",
    "qwen_vl_image_size",
    "read_image_records",
    "read_records",
    "render_chat_template",
    "sft_dataset",
    "tokens_in_spans",
    "validate_image_records",
    "validate_records",
    "verify_answer",
    "vision_counting_split",
    "write_image_records",
]

# The Hugging Face pipelines merged into the one set that takes any tokenizer, and the GGUF
# tokenizer moved to `tunelib.formats` with the rest of the GGUF format.
__getattr__ = moved_names(
    __name__,
    {
        "gguf_tokenizer": ("tunelib.formats", "gguf_tokenizer"),
        "gguf_tokenizer_metadata": ("tunelib.formats", "gguf_tokenizer_metadata"),
        "HF_REASONS": ("tunelib.data", "REASONS"),
        "encode_hf_records": ("tunelib.data", "encode_records"),
        "hf_preference_dataset": ("tunelib.data", "preference_dataset"),
        "hf_prompts": ("tunelib.data", "encode_prompts"),
        "hf_sft_dataset": ("tunelib.data", "sft_dataset"),
        "validate_hf_records": ("tunelib.data", "validate_records"),
    },
)
