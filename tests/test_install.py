"""The installation's promises: the repository's top-level `kernels/` folder (installed as
`tunelib.kernels`) is never the top-level module `kernels`, which is Hugging Face's package, a
dependency of `transformers`; neither in the test session nor from the repository root."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from tests._helpers import user_env
from tests._hf import hf_modules

ROOT = Path(__file__).resolve().parents[1]


def hugging_face_kernels() -> Path:
    """The `__init__.py` of the installed Hugging Face `kernels` distribution."""
    hf_modules()  # skips without torch and transformers, or fails under TUNELIB_REQUIRE_HF
    distribution = importlib.metadata.distribution("kernels")  # a transformers dependency
    return Path(distribution.locate_file("kernels/__init__.py")).resolve()


def test_kernels_in_the_test_session_is_hugging_faces_package():
    expected = hugging_face_kernels()
    import kernels

    assert Path(kernels.__file__).resolve() == expected, (kernels.__file__, expected)
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_transformers_imports_from_the_repository_root():
    """`python -c` (like a script in the root) puts the root first on `sys.path`."""
    expected = hugging_face_kernels()
    code = "import transformers.activations, kernels, tunelib.kernels; print(kernels.__file__)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Path(proc.stdout.strip()).resolve() == expected, proc.stdout
