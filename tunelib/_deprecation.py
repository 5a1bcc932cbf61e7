"""Old names that keep working for one release, with a `DeprecationWarning`.

Renames follow the conventions page (`docs/conventions.md`): the old name forwards to the new
one and warns once per call site, so user code keeps running while it is updated.
"""

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

# The release in which the old names stop working.
REMOVED_IN = "0.3.0"


def warn(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that `old` is deprecated in favour of `new`."""
    warnings.warn(
        f"{old} is deprecated and will be removed in tunelib {REMOVED_IN}; use {new} instead.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_arguments(**renames: str) -> Callable[[Callable], Callable]:
    """Accept each old keyword argument `old=new` under its old name, with a warning.

    Passing both the old and the new name is a `TypeError`.

    Examples:
      >>> import warnings
      >>> @renamed_arguments(beta="mix")
      ... def f(x, *, mix=0.5):
      ...     return x * mix
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     print(f(2.0, beta=0.25), caught[0].category.__name__)
      0.5 DeprecationWarning
    """

    def decorate(fn: Callable) -> Callable:
        parameters = inspect.signature(fn).parameters
        for old, new in renames.items():
            if new not in parameters:
                raise TypeError(f"{fn.__qualname__} has no argument {new!r} to rename {old!r} to.")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(
                            f"{fn.__name__}() got both {old!r} (deprecated) and {new!r}; "
                            f"pass {new!r} only."
                        )
                    warn(f"{fn.__qualname__}({old}=...)", f"{fn.__qualname__}({new}=...)")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def moved_names(module: str, moves: Mapping[str, tuple[str, str]]) -> Callable[[str], Any]:
    """A module `__getattr__` that serves names moved elsewhere, with a warning.

    `moves` maps an old name of `module` to `(new_module, new_name)`. Use it as
    `__getattr__ = moved_names(__name__, {...})` in the old module's `__init__.py`; the old
    names are not in its `__all__`.
    """

    def __getattr__(name: str) -> Any:
        if name not in moves:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, new_name = moves[name]
        warn(f"{module}.{name}", f"{new_module}.{new_name}")
        import importlib

        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__
