"""The project's own promises: the docs site builds, and CI runs the README's test command."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_gives_exactly_two_setup_commands_and_ci_runs_the_test_one():
    commands = readme_commands()
    assert len(commands) == 2, commands
    run_recipe, run_tests = commands
    assert "pip install" in run_recipe and "recipes/" in run_recipe
    assert run_tests.endswith("pytest")
    assert run_tests in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_docs_build_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is part of the test extras"
    proc = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "losses" / "index.html").exists()
    # Formulas render offline: MathJax is served with the site, nothing from another host.
    assert (tmp_path / "site" / "javascripts" / "tex-svg.js").stat().st_size > 1_000_000
    for page in (tmp_path / "site").rglob("*.html"):
        external = re.findall(
            r'<(?:script|link)[^>]+(?:src|href)="(https?://[^"]+)"', page.read_text()
        )
        assert not external, (page, external)


def test_every_subpackage_is_packaged():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        "tunelib." + p.parent.relative_to(ROOT / "tunelib").as_posix().replace("/", ".")
        for p in (ROOT / "tunelib").rglob("__init__.py")
        if p.parent != ROOT / "tunelib"
    } | {"tunelib", "tunelib.kernels"}
    assert listed == on_disk
    assert config["package-dir"]["tunelib.kernels"] == "kernels"
