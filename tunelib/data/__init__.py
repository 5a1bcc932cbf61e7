"""Data for post-training: a synthetic task, a tokenizer, record checks and Grain pipelines.

The built-in arithmetic task has a held-out split and an exact-match verifier; a character
tokenizer encodes it. Everything here runs on the host in Python and NumPy. Pipelines validate
records first (`validate_records`), then yield fixed-shape NumPy batches whose iterator state
is a JSON-serialisable dict, so training resumes the identical stream from a checkpoint.
"""

from tunelib.data._arithmetic import OPERATIONS, arithmetic_split, preference_pairs, verify_answer
from tunelib.data._pipelines import encode_prompts, preference_dataset, sft_dataset
from tunelib.data._records import REASONS, RecordError, RecordReport, validate_records
from tunelib.data._tokenizer import DEFAULT_ALPHABET, CharTokenizer, Tokenizer

__all__ = [
    "DEFAULT_ALPHABET",
    "OPERATIONS",
    "REASONS",
    "CharTokenizer",
    "RecordError",
    "RecordReport",
    "Tokenizer",
    "arithmetic_split",
    "encode_prompts",
    "preference_dataset",
    "preference_pairs",
    "sft_dataset",
    "validate_records",
    "verify_answer",
]
