"""A decoder that reads images: Gemma 4's vision encoder feeding its language model."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, PyTree

from tunelib import _validation as v
from tunelib._typing import Mask
from tunelib.models._config import DecoderConfig
from tunelib.models._decoder import Decoder, KVCache
from tunelib.models._vision import MultimodalEmbedder, VisionEncoder
from tunelib.models._vision_config import VisionConfig


class VisionLanguageModel(nnx.Module):
    r"""Gemma 4's vision-language model: image features at the image tokens of a `Decoder`.

    $$
    e_t = \begin{cases}
    W\,\mathrm{RMSNorm}\big(\mathrm{VisionEncoder}(\text{images})\big)_{r(t)} &
      x_t = \langle\mathrm{image}\rangle \\
    \sqrt{H}\, E_{x_t} & \text{otherwise}
    \end{cases}
    $$

    where $r(t)$ numbers the real image tokens of the batch in row-major order, as the real
    soft tokens of the images are numbered (image by image, in order): image $i$'s
    `num_soft_tokens_per_image[i]` soft tokens fill the next image tokens, wherever the rows'
    padding is (transformers' `masked_scatter`). The decoder then runs on $e$; the image
    tokens' per-layer inputs (Gemma 4) take the pad token's row; an image token with no soft
    token left (a sampled one, or any without images) is embedded as the pad token, as in
    transformers. With `bidirectional` (`use_bidirectional_attention = "vision"`), the
    sliding-window layers let an image's soft tokens (a run of image tokens) attend to each
    other both ways; full layers stay causal.

    It has the surface of a `Decoder` (`init_cache`, `extend`, `unembed`, `unembedding`,
    `decoding_layout`, `config` the language model's `DecoderConfig`), with the images as
    keyword arguments: `pixel_values` and `image_position_ids` as
    `tunelib.data.gemma4_image_inputs` returns them for the images of the batch, in order.

    Args:
      config: the language model's `DecoderConfig` (Gemma 4 text).
      vision_config: the encoder's `VisionConfig`.
      image_token_id: the token whose positions the soft tokens fill.
      pad_token_id: the token whose per-layer inputs image tokens take (Gemma 4: 0).
      bidirectional: image tokens attend within their image on the sliding layers.
      rngs: the `nnx.Rngs` the weights are drawn from.

    Examples:
      >>> import numpy as np, jax.numpy as jnp
      >>> from flax import nnx
      >>> from tunelib.data import expand_image_tokens, gemma4_image_inputs
      >>> from tunelib.models import DecoderConfig, VisionConfig, VisionLanguageModel
      >>> text = DecoderConfig(vocab_size=16, hidden_size=32, intermediate_size=64,
      ...                      num_hidden_layers=1, num_attention_heads=2, head_dim=16)
      >>> vision = VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
      ...                       num_attention_heads=2, num_key_value_heads=2, head_dim=8,
      ...                       patch_size=2, pooling_kernel_size=2,
      ...                       position_embedding_size=8)
      >>> model = VisionLanguageModel(text, vision, image_token_id=9, rngs=nnx.Rngs(0))
      >>> images = gemma4_image_inputs([np.zeros((8, 8, 3), np.uint8)], patch_size=2,
      ...                              max_soft_tokens=4, pooling_kernel_size=2)
      >>> ids, _ = expand_image_tokens([1, 9, 5], images["num_soft_tokens_per_image"],
      ...                              image_token_id=9)
      >>> ids.tolist()
      [1, 9, 9, 9, 9, 5]
      >>> hidden = model(ids[None], pixel_values=images["pixel_values"],
      ...                image_position_ids=images["image_position_ids"])
      >>> model.unembed(hidden).shape
      (1, 6, 16)

    References:
      transformers 5.25, `models/gemma4/modeling_gemma4.py`, `Gemma4Model.forward` and
      `create_masks_for_vision_model`.
    """

    def __init__(
        self,
        config: DecoderConfig,
        vision_config: VisionConfig,
        *,
        image_token_id: int,
        pad_token_id: int = 0,
        bidirectional: bool = False,
        rngs: nnx.Rngs,
    ):
        for name, value in (("image_token_id", image_token_id), ("pad_token_id", pad_token_id)):
            v.static_int(value, name)
            if not 0 <= value < config.vocab_size:
                raise ValueError(f"{name} must be in [0, {config.vocab_size}), got {value}.")
        if not isinstance(bidirectional, bool):
            raise TypeError(f"bidirectional must be a bool, got {bidirectional!r}.")
        self.config, self.vision_config = config, vision_config
        self.image_token_id, self.pad_token_id = image_token_id, pad_token_id
        self.bidirectional = bidirectional
        self.language_model = Decoder(config, rngs=rngs)
        self.vision_tower = VisionEncoder(vision_config, rngs=rngs)
        self.embed_vision = MultimodalEmbedder(vision_config, config, rngs=rngs)

    def __call__(
        self,
        tokens: Int[ArrayLike, "B T"],
        where: Mask[ArrayLike, "B T"] | None = None,
        positions: Int[ArrayLike, "B T"] | None = None,
        *,
        pixel_values: Float[ArrayLike, "I N Q"] | None = None,
        image_position_ids: Int[ArrayLike, "I N 2"] | None = None,
        routing: Int[ArrayLike, "M B T k"] | None = None,
    ) -> Float[Array, "B T H"]:
        """Final-norm hidden states of every position, the images at their image tokens.

        Args:
          tokens: `[B, T]` token ids, one image token per soft token of each image.
          where: `[B, T]` True on real tokens (None: all real).
          positions: `[B, T]` RoPE positions (None: as `Decoder`).
          pixel_values: `[I, N, 3 p^2]` patches of the batch's images, in the order their
            image tokens appear (row by row); None for text only.
          image_position_ids: `[I, N, 2]` their patch positions.
          routing: `[M, B, T, k]` experts to route to (replay; see `Decoder`).

        Returns:
          `[B, T, H]` hidden states, as `Decoder` returns them.
        """
        tokens, where, inputs = self._inputs(tokens, where, pixel_values, image_position_ids)
        return self.language_model(tokens, where, positions, routing=routing, **inputs)

    def extend(
        self,
        tokens: Int[ArrayLike, "B T"],
        where: Mask[ArrayLike, "B T"] | None,
        cache: KVCache,
        *,
        pixel_values: Float[ArrayLike, "I N Q"] | None = None,
        image_position_ids: Int[ArrayLike, "I N 2"] | None = None,
        routing: Int[ArrayLike, "M B T k"] | None = None,
        return_routing: bool = False,
    ) -> tuple[Float[Array, "B T H"], KVCache] | tuple[Array, KVCache, Array]:
        """`Decoder.extend` with the images of these tokens (the prefill of a prompt with
        images: each image's soft tokens lie in one call); `routing` and `return_routing`
        as there."""
        tokens, where, inputs = self._inputs(tokens, where, pixel_values, image_position_ids)
        return self.language_model.extend(
            tokens, where, cache, routing=routing, return_routing=return_routing, **inputs
        )

    def init_cache(self, batch_size: int, length: int, *, windowed: bool = False) -> KVCache:
        """The language model's `Decoder.init_cache`."""
        return self.language_model.init_cache(batch_size, length, windowed=windowed)

    def unembedding(self) -> Float[Array, "H V"]:
        """The language model's `Decoder.unembedding`."""
        return self.language_model.unembedding()

    def unembed(self, hidden: Float[ArrayLike, "*B H"]) -> Float[Array, "*B V"]:
        """The language model's `Decoder.unembed`: logits of hidden states."""
        return self.language_model.unembed(hidden)

    def decoding_layout(self, params: PyTree) -> PyTree:
        """`Decoder.decoding_layout` applied to the language model's parameters."""
        return {
            **params,
            "language_model": self.language_model.decoding_layout(params["language_model"]),
        }

    def image_features(
        self,
        pixel_values: Float[ArrayLike, "I N Q"],
        image_position_ids: Int[ArrayLike, "I N 2"],
    ) -> tuple[Float[Array, "I L H"], Mask[Array, "I L"]]:
        """The images' soft tokens in the language model's embedding space, `[I, L, H]`,
        and `[I, L]` True on each image's real ones (its first `num_soft_tokens`)."""
        soft_tokens, real = self.vision_tower(pixel_values, image_position_ids)
        return self.embed_vision(soft_tokens), real

    def _inputs(self, tokens, where, pixel_values, image_position_ids):
        """The tokens with image tokens read as padding ids, and the decoder's keyword
        arguments that place the image features and their attention blocks."""
        tokens = v.int_array(tokens, "tokens")
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [B, T], got {tokens.shape}.")
        where = v.mask_array(where, tokens.shape, "where")
        if (pixel_values is None) != (image_position_ids is None):
            raise ValueError("pixel_values and image_position_ids must be given together.")
        image = (tokens == self.image_token_id) & where
        inputs = {}
        if pixel_values is not None:
            features, real = self.image_features(pixel_values, image_position_ids)
            flat = features.reshape(-1, features.shape[-1])
            (source,) = jnp.nonzero(real.reshape(-1), size=flat.shape[0], fill_value=0)
            rank = jnp.cumsum(image.reshape(-1)) - 1
            # Image tokens past the images' soft tokens (say, sampled ones) stay padding.
            filled = (image.reshape(-1) & (rank < real.sum())).reshape(tokens.shape)
            index = jnp.take(source, jnp.clip(rank, 0, flat.shape[0] - 1))
            placed = jnp.take(flat, index, axis=0)
            inputs["embeddings"] = placed.reshape(*tokens.shape, -1)
            inputs["embeddings_where"] = filled
            if self.bidirectional:
                inputs["blocks"] = _image_blocks(filled)
        tokens = jnp.where(image, self.pad_token_id, tokens)
        return tokens, where, inputs


def _image_blocks(image: jax.Array) -> jax.Array:
    """`[B, T]` block ids: the runs of image tokens of a row numbered 0, 1, ..., -1 elsewhere
    (transformers' `get_block_sequence_ids_for_mask`)."""
    before = jnp.pad(image[:, :-1], ((0, 0), (1, 0)))
    starts = image & ~before
    return jnp.where(image, jnp.cumsum(starts, axis=1) - 1, -1)
