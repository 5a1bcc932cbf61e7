"""tunelib: post-training building blocks for language models in JAX.

The public API lives in the subpackages: `tunelib.logprobs`, `tunelib.losses`,
`tunelib.advantages`, `tunelib.models`, `tunelib.data` and `tunelib.kernels`.
"""

__version__ = "0.1.0"
