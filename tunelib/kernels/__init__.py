"""Pallas kernels, installed as `tunelib.kernels`.

Each kernel implements the signature of a pure-JAX reference elsewhere in tunelib and is tested
against it in interpret mode on CPU:

- `fused_token_logps_pallas`: per-token log-probs (and entropy) straight from hidden states
  and the unembedding, the kernel behind `tunelib.logprobs.fused_token_logps(...,
  implementation="pallas")`, with GPU (Triton) and TPU (Mosaic) lowerings.
- `nf4_matmul_pallas`: a matrix product with an NF4 weight decoded tile by tile (Triton
  lowering), behind `tunelib.peft` products with `NF4Tensor`s built with `matmul="pallas"`.

This file is the package's `__init__`; its modules are the repository's top-level `kernels/`
folder, which setuptools installs here. That folder has no `__init__.py`, so that from the
repository root it is never the top-level module `kernels`, which is Hugging Face's package
(docs/architecture.md, "The kernels folder").
"""

from tunelib.kernels._fused_logps import fused_token_logps_pallas
from tunelib.kernels._nf4_matmul import nf4_matmul_pallas

__all__ = [
    "fused_token_logps_pallas",
    "nf4_matmul_pallas",
]
