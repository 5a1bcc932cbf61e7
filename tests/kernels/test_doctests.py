"""The kernels' docstring examples, run through the installed `tunelib.kernels`.

pytest's `--doctest-modules` collects files by path. The top-level `kernels/` folder is not a
package (it has no `__init__.py`, so that it never shadows Hugging Face's `kernels`), and
collecting it by path would import its modules a second time under names of pytest's making.
Its doctests are run here from the modules as tunelib imports them instead.
"""

import doctest
import importlib
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
MODULES = sorted(f"tunelib.kernels.{path.stem}" for path in KERNELS.glob("*.py"))


def docstring_examples() -> list[doctest.DocTest]:
    found = []
    for name in MODULES:
        module = importlib.import_module(name)
        assert Path(module.__file__).parent == KERNELS, (name, module.__file__)
        found += [t for t in doctest.DocTestFinder().find(module, name) if t.examples]
    return found


def test_the_kernels_folder_is_searched():
    assert "tunelib.kernels._fused_logps" in MODULES and "tunelib.kernels._nf4_matmul" in MODULES
    names = {test.name.rpartition(".")[2] for test in docstring_examples()}
    assert names == {"fused_token_logps_pallas", "nf4_matmul_pallas"}


@pytest.mark.parametrize("test", docstring_examples(), ids=lambda test: test.name)
def test_docstring_example(test):
    result = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE).run(test)
    assert result.attempted > 0 and result.failed == 0, f"{result.failed} examples failed"
