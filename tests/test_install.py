"""The installation's promises: the repository's top-level `kernels/` folder (installed as
`tunelib.kernels`) is never the top-level module `kernels`, which is Hugging Face's package, a
dependency of `transformers`; neither in the test session nor from the repository root."""

import importlib.metadata
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


def test_the_wheel_holds_tunelib_kernels_and_no_top_level_kernels(tmp_path):
    """A wheel (not the editable install the tests run on) puts the package's `__init__.py`
    and the kernels folder's modules in one `tunelib/kernels/`, and nothing at the top."""
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*build, "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("tunelib-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    modules = {f"tunelib/kernels/{path.name}" for path in (ROOT / "kernels").glob("*.py")}
    assert modules | {"tunelib/kernels/__init__.py"} <= names
    assert not any(name.startswith("kernels/") for name in names)
    code = "import tunelib.kernels as k; print(k.__file__, k.fused_token_logps_pallas.__module__)"
    env = user_env() | {"PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    path, module = proc.stdout.split()
    assert Path(path) == tmp_path / "site" / "tunelib" / "kernels" / "__init__.py"
    assert module == "tunelib.kernels._fused_logps"


def locked_versions() -> dict[str, str]:
    """requirements/test.lock's pins: normalised name -> version."""
    text = (ROOT / "requirements" / "test.lock").read_text()
    pins = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", text, re.M)
    return {canonicalize_name(name): version for name, version in pins}


def test_the_lock_satisfies_every_declared_requirement_of_the_test_extra():
    """The lock the README's test command installs is the test extra resolved: every
    requirement of the library and of the extras the test extra pulls in has a pin that
    satisfies it. (`bash .ci/upstream --refresh` rewrites the lock after a change here.)"""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements, pending, seen = list(project["dependencies"]), ["test"], set()
    while pending:
        extra = pending.pop()
        seen.add(extra)
        for text in extras[extra]:
            requirement = Requirement(text)
            if requirement.name == project["name"]:
                pending += [e for e in requirement.extras if e not in seen]
            else:
                requirements.append(text)
    locked = locked_versions()
    assert len(requirements) > 30 and len(locked) > 100
    for text in requirements:
        requirement = Requirement(text)
        version = locked.get(canonicalize_name(requirement.name))
        assert version is not None, f"{requirement.name} is not in requirements/test.lock"
        assert requirement.specifier.contains(version, prereleases=True), (text, version)
