"""JAX's persistent compilation cache: a run that starts again (after a crash, a
preemption, `--resume auto` from a scheduler) loads its compiled programs from disk instead
of compiling them again, which is most of a small run's start-up; on an accelerator, every
later run of the same shapes does too.

    with compile_cache.used(config.compile_cache, run.path):
        train(config, run)

`--compile-cache DIR` puts the cache in DIR (shared by several runs, it serves each the
programs of the same shapes), `--compile-cache none` compiles afresh. By default it is kept
beside the run, `OUT/compile_cache`, on a CPU; on a machine whose JAX has a TPU or GPU
(`accelerator_machine`) it is one folder for every run of the user, `default_folder()`
(`~/.cache/tunelib/jax`): there compiling a recipe's programs took most of a short run
(28 of the 68 s of the SmolLM2 SFT on a TPU v5e), and the second run of a recipe finds
them. Where JAX is told where its cache is already (`JAX_COMPILATION_CACHE_DIR` or
`jax.config`), that is kept as it is. Every program is cached, however fast it compiled and
however small it is (JAX's own defaults skip those under a second), since a small run's
start-up is many of them. JAX writes the cache from process 0 of a run only, and reads it
from every process. Nothing here imports JAX at import time, and nothing starts its backend:
a chained run (`kit.chain`) must be able to open the devices after this.
"""

import contextlib
import importlib.util
import os
import pkgutil
from collections.abc import Iterator
from pathlib import Path

from kit.config import compile_cache_folder

FOLDER = "compile_cache"  # the cache's folder in a run folder

# What makes every program cacheable, CPU ones included: no minimum compile time, and no
# minimum entry size (-1 also keeps JAX from choosing one for the file system).
CACHE_EVERYTHING = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}


def default_folder() -> Path:
    """The cache every run of the user shares on an accelerator: `tunelib/jax` in the user's
    cache folder (`$XDG_CACHE_HOME`, else `~/.cache`)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tunelib" / "jax"


def accelerator_machine(platforms: str | None) -> bool:
    """Whether JAX here runs on a TPU or a GPU, told without starting its backend: from
    JAX's platforms setting when one is given (`JAX_PLATFORMS`), else from the accelerator
    plugins installed (libtpu; JAX's CUDA and ROCm plugins, found in `jax_plugins`)."""
    if platforms:
        return platforms.split(",")[0].strip().lower() != "cpu"
    if importlib.util.find_spec("libtpu") is not None:
        return True
    return gpu_machine(None)


def gpu_machine(platforms: str | None) -> bool:
    """Whether JAX here runs on a GPU, told as `accelerator_machine` tells it."""
    if platforms:
        return platforms.split(",")[0].strip().lower() in ("gpu", "cuda", "rocm")
    spec = importlib.util.find_spec("jax_plugins")
    if spec is None or spec.submodule_search_locations is None:
        return False
    plugins = pkgutil.iter_modules(spec.submodule_search_locations)
    return any(p.name.startswith(("xla_cuda", "xla_rocm")) for p in plugins)


def settings(
    setting: str | None,
    out: Path | None,
    configured: str | None,
    *,
    accelerator: bool = False,
    gpu: bool = False,
) -> dict | None:
    """The JAX settings a run with `--compile-cache setting` in run folder `out` makes, or
    None to leave JAX as it is: without the flag when JAX has a cache folder already
    (`configured`), or when there is no run folder (`--plan` writes nothing). Without the
    flag the cache is `out`'s, or the user's (`default_folder`) on an `accelerator`.

    Except on a `gpu`, JAX is told not to keep XLA's own caches in the folder: it names
    their folder (GPU autotuning's, of no use elsewhere) among the options every program's
    key is made of, so that a run folder copied or moved elsewhere missed every program of
    its cache (the toy SFT, resumed from a copy of its folder, compiled all 28 of its
    programs again; with this setting 1, as when it resumes where it was)."""
    if setting is None and (configured or out is None):
        return None
    if setting is not None:
        folder = compile_cache_folder(setting)
    else:
        folder = default_folder() if accelerator else out / FOLDER
    if folder is None:  # --compile-cache none
        return {"jax_enable_compilation_cache": False}
    return {
        "jax_enable_compilation_cache": True,
        "jax_compilation_cache_dir": str(folder.resolve()),
        **CACHE_EVERYTHING,
        **({} if gpu else {"jax_persistent_cache_enable_xla_caches": "none"}),
    }


@contextlib.contextmanager
def used(setting: str | None, out: Path | None) -> Iterator[None]:
    """Use the compilation cache `settings` says inside the block (before anything is
    compiled), and put JAX's settings back after it, so that a run in a process that goes
    on (a test, a notebook) leaves the next one JAX's own. JAX is imported only when there
    may be something to set (`--plan` checks what it can before JAX is imported)."""
    if setting is None and out is None:
        yield
        return
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    platforms = jax.config.jax_platforms
    wanted = settings(
        setting, out, jax.config.jax_compilation_cache_dir,
        accelerator=accelerator_machine(platforms), gpu=gpu_machine(platforms),
    )  # fmt: skip
    if wanted is None:
        yield
        return
    previous = {name: getattr(jax.config, name) for name in wanted}
    for name, value in wanted.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # JAX opens its cache once, at the first compilation
    try:
        yield
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
