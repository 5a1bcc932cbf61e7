"""Pallas kernels, installed as `tunelib.kernels`.

Each kernel implements the signature of a pure-JAX reference elsewhere in tunelib and is tested
against it in interpret mode on CPU. None is shipped yet.
"""

__all__: list[str] = []
