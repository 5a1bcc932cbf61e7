"""Data for post-training: a synthetic task, tokenizers, record checks and Grain pipelines.

The built-in arithmetic task has a held-out split and an exact-match verifier; a character
tokenizer encodes it. Real data comes as Hugging Face-shaped records (chat `messages`,
prompt-completion, preference pairs, prompt-answer) from JSON-lines or Parquet files, and is
tokenized by a checkpoint's own `tokenizer.json` and chat template (`HFTokenizer`). Everything
here runs on the host in Python and NumPy. Pipelines validate records first, then yield
fixed-shape NumPy batches whose iterator state is a JSON-serialisable dict, so training resumes
the identical stream from a checkpoint.
"""

from tunelib.data._arithmetic import OPERATIONS, arithmetic_split, preference_pairs, verify_answer
from tunelib.data._chat_template import (
    TemplateError,
    completion_spans,
    encode_chat,
    render_chat_template,
    tokens_in_spans,
)
from tunelib.data._hf_pipelines import (
    encode_hf_records,
    hf_preference_dataset,
    hf_prompts,
    hf_sft_dataset,
)
from tunelib.data._hf_records import HF_REASONS, read_records, validate_hf_records
from tunelib.data._hf_tokenizer import HFTokenizer
from tunelib.data._pipelines import encode_prompts, preference_dataset, sft_dataset
from tunelib.data._records import REASONS, RecordError, RecordReport, validate_records
from tunelib.data._tokenizer import DEFAULT_ALPHABET, CharTokenizer, Tokenizer

__all__ = [
    "DEFAULT_ALPHABET",
    "HF_REASONS",
    "OPERATIONS",
    "REASONS",
    "CharTokenizer",
    "HFTokenizer",
    "RecordError",
    "RecordReport",
    "TemplateError",
    "Tokenizer",
    "arithmetic_split",
    "completion_spans",
    "encode_chat",
    "encode_hf_records",
    "encode_prompts",
    "hf_preference_dataset",
    "hf_prompts",
    "hf_sft_dataset",
    "preference_dataset",
    "preference_pairs",
    "read_records",
    "render_chat_template",
    "sft_dataset",
    "tokens_in_spans",
    "validate_hf_records",
    "validate_records",
    "verify_answer",
]
