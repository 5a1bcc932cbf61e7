"""A decoder that reads images: Gemma 4's or Qwen3.5's vision encoder feeding its language
model."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, PyTree

from tunelib import _validation as v
from tunelib._typing import Mask
from tunelib.models._config import DecoderConfig
from tunelib.models._decoder import Decoder, KVCache
from tunelib.models._mrope import mrope_positions
from tunelib.models._qwen_vision import QwenVisionEncoder
from tunelib.models._qwen_vision_config import QwenVisionConfig
from tunelib.models._vision import MultimodalEmbedder, VisionEncoder
from tunelib.models._vision_config import VisionConfig

# The image arrays each family's encoder reads, as its preprocessing returns them.
GEMMA4_IMAGE_INPUTS = ("pixel_values", "image_position_ids")
QWEN_IMAGE_INPUTS = ("pixel_values", "image_grid_thw")


class VisionLanguageModel(nnx.Module):
    r"""Gemma 4's or Qwen3.5's vision-language model: image features at the image tokens of a
    `Decoder`.

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

    With a `QwenVisionConfig` (Qwen3.5), the encoder is `QwenVisionEncoder` (`visual`),
    whose merged tokens are the features themselves ($e_t = \mathrm{QwenVisionEncoder}
    (\text{images})_{r(t)}$ at image tokens, $E_{x_t}$ elsewhere), and a prompt with images
    takes the 3-D positions of `tunelib.models.mrope_positions` (the language model's
    `mrope_section` set): in a forward pass over the whole sequence, and in the `extend`
    that prefills it on an empty cache, after which decoding continues from one past each
    row's largest position (transformers' position delta).

    It has the surface of a `Decoder` (`init_cache`, `extend`, `unembed`, `unembedding`,
    `decoding_layout`, `config` the language model's `DecoderConfig`), with the images as
    keyword arguments, named in `image_inputs`: Gemma 4's `pixel_values` and
    `image_position_ids` as `tunelib.data.gemma4_image_inputs` returns them, Qwen3.5's
    `pixel_values` and `image_grid_thw` as `tunelib.data.qwen_vl_image_inputs` does, for the
    images of the batch in order.

    Args:
      config: the language model's `DecoderConfig` (Gemma 4 text or Qwen3.5 text).
      vision_config: the encoder's `VisionConfig` (Gemma 4) or `QwenVisionConfig`
        (Qwen3.5).
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
        vision_config: VisionConfig | QwenVisionConfig,
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
        qwen = isinstance(vision_config, QwenVisionConfig)
        if qwen and vision_config.out_hidden_size != config.hidden_size:
            raise ValueError(
                f"vision_config.out_hidden_size ({vision_config.out_hidden_size}) must equal "
                f"the language model's hidden_size ({config.hidden_size})."
            )
        if qwen and config.mrope_section is None:
            raise ValueError(
                "config.mrope_section must be set for a Qwen3.5 vision-language model: its "
                "image tokens take 3-D positions."
            )
        self.config, self.vision_config = config, vision_config
        self.image_token_id, self.pad_token_id = image_token_id, pad_token_id
        self.bidirectional = bidirectional
        self.image_inputs = QWEN_IMAGE_INPUTS if qwen else GEMMA4_IMAGE_INPUTS
        self.language_model = Decoder(config, rngs=rngs)
        if qwen:
            self.visual = QwenVisionEncoder(vision_config, rngs=rngs)
        else:
            self.vision_tower = VisionEncoder(vision_config, rngs=rngs)
            self.embed_vision = MultimodalEmbedder(vision_config, config, rngs=rngs)

    def __call__(
        self,
        tokens: Int[ArrayLike, "B T"],
        where: Mask[ArrayLike, "B T"] | None = None,
        positions: Int[ArrayLike, "B T"] | Int[ArrayLike, "3 B T"] | None = None,
        *,
        pixel_values: Float[ArrayLike, "*P N Q"] | None = None,
        image_position_ids: Int[ArrayLike, "I N 2"] | None = None,
        image_grid_thw: Int[ArrayLike, "I 3"] | None = None,
        routing: Int[ArrayLike, "M B T k"] | None = None,
    ) -> Float[Array, "B T H"]:
        """Final-norm hidden states of every position, the images at their image tokens.

        Args:
          tokens: `[B, T]` token ids, one image token per soft token of each image.
          where: `[B, T]` True on real tokens (None: all real).
          positions: `[B, T]` (or `[3, B, T]`) RoPE positions; None: as `Decoder`, or for
            Qwen3.5 with images, `tunelib.models.mrope_positions`.
          pixel_values: the patches of the batch's images, in the order their image tokens
            appear (row by row): Gemma 4's `[I, N, 3 p^2]`, Qwen3.5's `[N, Q]` (the images'
            patches one after the other); None for text only.
          image_position_ids: Gemma 4: `[I, N, 2]` their patch positions.
          image_grid_thw: Qwen3.5: `[I, 3]` their patch grids.
          routing: `[M, B, T, k]` experts to route to (replay; see `Decoder`).

        Returns:
          `[B, T, H]` hidden states, as `Decoder` returns them.
        """
        images = {"pixel_values": pixel_values, "image_position_ids": image_position_ids,
                  "image_grid_thw": image_grid_thw}  # fmt: skip
        tokens, where, inputs = self._inputs(tokens, where, images, positions)
        return self.language_model(tokens, where, routing=routing, **inputs)

    def extend(
        self,
        tokens: Int[ArrayLike, "B T"],
        where: Mask[ArrayLike, "B T"] | None,
        cache: KVCache,
        *,
        pixel_values: Float[ArrayLike, "*P N Q"] | None = None,
        image_position_ids: Int[ArrayLike, "I N 2"] | None = None,
        image_grid_thw: Int[ArrayLike, "I 3"] | None = None,
        routing: Int[ArrayLike, "M B T k"] | None = None,
        return_routing: bool = False,
    ) -> tuple[Float[Array, "B T H"], KVCache] | tuple[Array, KVCache, Array]:
        """`Decoder.extend` with the images of these tokens (the prefill of a prompt with
        images: each image's soft tokens lie in one call; for Qwen3.5, the whole prompt in
        one call on an empty cache); `routing` and `return_routing` as there."""
        images = {"pixel_values": pixel_values, "image_position_ids": image_position_ids,
                  "image_grid_thw": image_grid_thw}  # fmt: skip
        tokens, where, inputs = self._inputs(tokens, where, images, None)
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
        pixel_values: Float[ArrayLike, "*P N Q"],
        image_position_ids: Int[ArrayLike, "I N 2"] | None = None,
        *,
        image_grid_thw: Int[ArrayLike, "I 3"] | None = None,
    ) -> tuple[Float[Array, "*P L H"], Mask[Array, "*P L"]]:
        """The images' soft tokens in the language model's embedding space and which are
        real: Gemma 4's `[I, L, H]` and `[I, L]` (each image's first `num_soft_tokens`) from
        `image_position_ids`; Qwen3.5's `[L, H]` and `[L]` (the images' merged tokens one
        after the other) from `image_grid_thw`."""
        if self.image_inputs == QWEN_IMAGE_INPUTS:
            if image_grid_thw is None:
                raise ValueError("image_grid_thw is required with pixel_values for Qwen3.5.")
            return self.visual(pixel_values, image_grid_thw)
        if image_position_ids is None:
            raise ValueError("image_position_ids is required with pixel_values for Gemma 4.")
        soft_tokens, real = self.vision_tower(pixel_values, image_position_ids)
        return self.embed_vision(soft_tokens), real

    def _inputs(self, tokens, where, images, positions):
        """The tokens with image tokens read as padding ids, and the decoder's keyword
        arguments that place the image features (and their attention blocks, or 3-D
        positions)."""
        tokens = v.int_array(tokens, "tokens")
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [B, T], got {tokens.shape}.")
        where = v.mask_array(where, tokens.shape, "where")
        given = {name for name, value in images.items() if value is not None}
        if given and given != set(self.image_inputs):
            raise ValueError(
                f"this model reads images as {' and '.join(self.image_inputs)}, given "
                f"together; got {sorted(given)}."
            )
        image = (tokens == self.image_token_id) & where
        inputs = {} if positions is None else {"positions": positions}
        if given:
            features, real = self.image_features(
                images["pixel_values"],
                images["image_position_ids"],
                image_grid_thw=images["image_grid_thw"],
            )
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
            if positions is None and self.image_inputs == QWEN_IMAGE_INPUTS:
                inputs["positions"], _ = mrope_positions(
                    tokens,
                    where,
                    images["image_grid_thw"],
                    image_token_id=self.image_token_id,
                    spatial_merge_size=self.vision_config.spatial_merge_size,
                )
        tokens = jnp.where(image, self.pad_token_id, tokens)
        return tokens, where, inputs


def _image_blocks(image: jax.Array) -> jax.Array:
    """`[B, T]` block ids: the runs of image tokens of a row numbered 0, 1, ..., -1 elsewhere
    (transformers' `get_block_sequence_ids_for_mask`)."""
    before = jnp.pad(image[:, :-1], ((0, 0), (1, 0)))
    starts = image & ~before
    return jnp.where(image, jnp.cumsum(starts, axis=1) - 1, -1)
