"""JAX's persistent compilation cache, kept beside the run: a run that starts again (after a
crash, a preemption, `--resume auto` from a scheduler) loads its compiled programs from disk
instead of compiling them again, which is most of a small run's start-up.

    with compile_cache.used(config.compile_cache, run.path):
        train(config, run)

`--compile-cache DIR` puts the cache in DIR (shared by several runs, it serves each the
programs of the same shapes), `--compile-cache none` compiles afresh; by default it is
`OUT/compile_cache`, unless JAX is told where its cache is already (`JAX_COMPILATION_CACHE_DIR`
or `jax.config`), which is then kept as it is. Every program is cached, however fast it
compiled and however small it is (JAX's own defaults skip those under a second), since a
small run's start-up is many of them. JAX writes the cache from process 0 of a run only,
and reads it from every process. Nothing here imports JAX at import time.
"""

import contextlib
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


def settings(setting: str | None, out: Path | None, configured: str | None) -> dict | None:
    """The JAX settings a run with `--compile-cache setting` in run folder `out` makes, or
    None to leave JAX as it is: without the flag when JAX has a cache folder already
    (`configured`), or when there is no run folder (`--plan` writes nothing)."""
    if setting is None and (configured or out is None):
        return None
    folder = compile_cache_folder(setting) if setting is not None else out / FOLDER
    if folder is None:  # --compile-cache none
        return {"jax_enable_compilation_cache": False}
    return {
        "jax_enable_compilation_cache": True,
        "jax_compilation_cache_dir": str(folder.resolve()),
        **CACHE_EVERYTHING,
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

    wanted = settings(setting, out, jax.config.jax_compilation_cache_dir)
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
