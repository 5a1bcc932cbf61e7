"""Running the recipes in the tests: as a user runs them (a process of their own), without
JAX where nothing should need it, or in this process where only the errors matter."""

import contextlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

from tests._helpers import load_script, user_env

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
if str(RECIPES) not in sys.path:
    sys.path.insert(0, str(RECIPES))

# A recipe's jitted functions take the weights they read as arguments: weights closed over
# would be compiled into the program as constants (`kit.lora.Tuning.params`). A recipe run
# here fails when one of its programs captures more bytes of constants than this (JAX's
# warning, made an error); the test models' smallest weight matrix is 65,536 bytes.
CAPTURED_CONSTANTS_LIMIT = 20_000
_CAPTURED = "A large amount of constants were captured"


@contextlib.contextmanager
def no_captured_weights():
    """In this process: JAX's captured-constants warning at `CAPTURED_CONSTANTS_LIMIT`
    bytes, raised as an error."""
    import jax

    before = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", CAPTURED_CONSTANTS_LIMIT)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=_CAPTURED)
            yield
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", before)


# Runs a recipe with `import jax` (and everything that would bring it in) made impossible.
_WITHOUT_JAX = """
import runpy, sys
for name in ("jax", "jaxlib", "flax", "optax", "orbax", "grain", "tunelib"):
    sys.modules[name] = None
sys.path.insert(0, {recipes!r})
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def run_without_jax(
    recipe: str, *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`python recipes/<recipe>.py ARGS` in a process where importing JAX or tunelib fails."""
    script = str(RECIPES / f"{recipe}.py")
    code = _WITHOUT_JAX.format(recipes=str(RECIPES), script=script)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=60, env=user_env(), cwd=cwd, check=False,
    )  # fmt: skip


def run_recipe_process(recipe: str, *args: str, timeout: float = 300, cwd=None, env=None):
    """`python recipes/<recipe>.py ARGS` as a user runs it (one CPU device)."""
    environment = user_env(compilation_cache=True)
    environment["JAX_CAPTURED_CONSTANTS_WARN_BYTES"] = str(CAPTURED_CONSTANTS_LIMIT)
    environment["PYTHONWARNINGS"] = f"error:{_CAPTURED}"
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, str(RECIPES / f"{recipe}.py"), *args],
        capture_output=True, text=True, timeout=timeout, env=environment, cwd=cwd,
        check=False,
    )  # fmt: skip


_MODULES: dict = {}


def recipe_module(recipe: str):
    """The recipe script as a module (loaded once), to call it through `kit.cli.main` here."""
    if recipe not in _MODULES:
        _MODULES[recipe] = load_script(RECIPES / f"{recipe}.py", f"recipe_{recipe}")
    return _MODULES[recipe]


def recipe_main(recipe: str, argv: list[str]):
    """`kit.cli.main` of the recipe with `argv`, in this process: the recipe's result dict, or
    `SystemExit` for a failure (status 2 and one line on stderr, or 130 when interrupted)."""
    import kit

    module = recipe_module(recipe)
    config_type = next(
        v
        for v in vars(module).values()
        if isinstance(v, type) and getattr(v, "RECIPE", None) == recipe
    )
    train = module.generate if recipe == "generate" else module.train
    with no_captured_weights():
        return kit.cli.main(config_type, train, module.__doc__, argv=argv)


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `folder` with its size and modification time."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            stat = path.stat()
            out[str(path.relative_to(folder))] = (stat.st_size, stat.st_mtime_ns)
    return out
