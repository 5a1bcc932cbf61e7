"""The KV-cache sampler: `sample` and its config and output, on the rollout core
(`tunelib.rollout._decoding`)."""

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Int, PyTree, UInt32

from tunelib import _validation as v
from tunelib.data import Tokenizer
from tunelib.rollout._compiled import program
from tunelib.rollout._decoding import (
    LAYOUTS,
    PRODUCTS,
    Layout,
    Products,
    as_key,
    check_record_routing,
    checked_images,
    checked_prompts,
    decode,
    decoding_params,
    prefill,
    products_context,
    pure_params,
)
from tunelib.rollout._policy import check_version, stamp
from tunelib.rollout._processors import check_sampling_values

LogpsOf = Literal["tempered", "processed"]


class NoStopTokenWarning(UserWarning):
    """A `SamplingConfig` made for a tokenizer that has stop tokens was told to use none, so
    every completion runs to `max_new_tokens`, past the end of the model's turn."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How `sample` draws completions. Static: each distinct config compiles once.

    Every field is checked when the config is made, with a `TypeError` or `ValueError` that
    names it; what depends on the model's vocabulary (token ids below its size, not every
    token forbidden) is checked by `sample`, before anything compiles. Numbers are stored as
    Python ints and floats, token ids as tuples of ints.

    Attributes:
      max_new_tokens: the most tokens generated per completion, stop token included; an int
        >= 1.
      temperature: $\\tau \\ge 0$, finite; the next token is drawn from
        `softmax(logits / τ)` after the filters below. 0 is exact greedy decoding (argmax over
        the allowed tokens); a positive τ is at least float32's smallest normal number
        (1.2e-38, below which it is flushed to 0). Where τ is so small that the logits over
        it overflow, each row is shifted by its largest logit first: the same distribution,
        which then draws the argmax.
      top_k: keep the k most likely tokens, an int >= 1 (None: all).
      top_p: nucleus sampling, keep the smallest most-likely set with probability >= p,
        p in (0, 1] (None: all).
      min_p: keep the tokens with probability >= min_p times the largest, min_p in [0, 1]
        (None: all).
      forbidden_tokens: token ids (ints >= 0) never sampled.
      stop_tokens: token ids (ints >= 0) that end a completion; the stop token itself is part
        of the completion (inside `Rollout.where`), nothing after it is.
      pad_token: the id (an int >= 0) written after a completion ends (outside
        `Rollout.where`).
      cache_length: KV-cache slots, at least `max_new_tokens + 1` (a prompt has a token at
        least); None means prompt length + `max_new_tokens`, the least that fits. A larger
        cache lets one compiled sampler serve longer prompts.
      logps_of: which distribution `Rollout.logps` are taken from: "tempered" (default),
        the full vocabulary at the sampling temperature, `log_softmax(logits / τ)` before any
        filter: what a trainer recomputes from its own logits, so the ratio of the two is
        the sampler/trainer mismatch; or "processed", the distribution actually sampled
        from (filters applied, excluded tokens at probability 0). At temperature 0 both are
        the untempered `log_softmax(logits)`: finite, and what a trainer at temperature 1
        recomputes.
    """

    max_new_tokens: int
    temperature: float | int = 1.0
    top_k: int | None = None
    top_p: float | int | None = None
    min_p: float | int | None = None
    forbidden_tokens: tuple[int, ...] = ()
    stop_tokens: tuple[int, ...] = ()
    pad_token: int = 0
    cache_length: int | None = None
    logps_of: LogpsOf = "tempered"

    def __post_init__(self) -> None:
        v.static_int(self.max_new_tokens, "max_new_tokens")
        v.number_in(self.max_new_tokens, "max_new_tokens", low=1)
        check_sampling_values(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p
        )
        tokens = {
            name: v.token_id_tuple(getattr(self, name), name)
            for name in ("forbidden_tokens", "stop_tokens")
        }
        v.static_int(self.pad_token, "pad_token")
        v.number_in(self.pad_token, "pad_token", low=0, hint="token ids are >= 0")
        if self.cache_length is not None:
            v.static_int(self.cache_length, "cache_length")
            v.number_in(
                self.cache_length,
                "cache_length",
                low=self.max_new_tokens + 1,
                hint=f"max_new_tokens={self.max_new_tokens} slots and one for a prompt token",
            )
        v.one_of(self.logps_of, "logps_of", ("tempered", "processed"))
        normalized = {
            **tokens,
            "max_new_tokens": int(self.max_new_tokens),
            "temperature": float(self.temperature),
            "top_k": None if self.top_k is None else int(self.top_k),
            "top_p": None if self.top_p is None else float(self.top_p),
            "min_p": None if self.min_p is None else float(self.min_p),
            "pad_token": int(self.pad_token),
            "cache_length": None if self.cache_length is None else int(self.cache_length),
        }
        for name, value in normalized.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Tokenizer, *, max_new_tokens: int, **overrides: Any
    ) -> "SamplingConfig":
        """A config that stops where `tokenizer`'s model ends a turn and pads with its pad id.

        `stop_tokens` is `tokenizer.stop_ids` (EOS first; for a chat model such as SmolLM2
        also `<|im_end|>`) and `pad_token` is `tokenizer.pad_id`; any other field, or these
        two, may be given as keywords. The plain constructor's defaults (no stop token, pad
        id 0) know nothing of the vocabulary: with them a chat model's completion runs past
        the end of its turn into whatever it writes next.

        Overriding `stop_tokens` with `()` for a tokenizer that has stop ids warns with a
        `NoStopTokenWarning` (once per call site, Python's default for warnings): fixed-length
        completions are sometimes wanted (benchmarks), but mostly this is a mistake. `sample`
        cannot warn about a config without stop tokens itself: it never sees the tokenizer,
        and a config without them is right for a model or a task that has none.

        Args:
          tokenizer: any `tunelib.data.Tokenizer` (`CharTokenizer`, `HFTokenizer`, a GGUF
            file's tokenizer).
          max_new_tokens: the most tokens generated per completion, stop token included.
          **overrides: other `SamplingConfig` fields (`temperature`, `top_p`, ...).

        Returns:
          A `SamplingConfig`, checked as the constructor checks it.

        Raises:
          TypeError: if `tokenizer` has no `stop_ids` or `pad_id`, or a keyword is not a
            field.

        Examples:
          >>> from tunelib.data import CharTokenizer
          >>> from tunelib.rollout import SamplingConfig
          >>> tok = CharTokenizer()
          >>> config = SamplingConfig.from_tokenizer(tok, max_new_tokens=8, temperature=0.7)
          >>> config.stop_tokens, config.pad_token, config.temperature
          ((2,), 0, 0.7)
        """
        missing = [name for name in ("stop_ids", "pad_id") if not hasattr(tokenizer, name)]
        if missing:
            raise TypeError(
                f"tokenizer must be a tunelib.data.Tokenizer; {type(tokenizer).__name__} has "
                f"no {' or '.join(missing)}."
            )
        fields = {"stop_tokens": tuple(tokenizer.stop_ids), "pad_token": tokenizer.pad_id}
        config = cls(max_new_tokens=max_new_tokens, **(fields | overrides))
        if fields["stop_tokens"] and not config.stop_tokens:
            warnings.warn(
                f"stop_tokens=() overrides the tokenizer's stop ids {fields['stop_tokens']}: "
                f"every completion runs to max_new_tokens={config.max_new_tokens}, past the "
                "end of the model's turn.",
                NoStopTokenWarning,
                stacklevel=2,
            )
        return config


class Rollout(NamedTuple):
    """Completions from `sample`, one row per completion: a pytree of arrays, so it passes
    through `jax.jit` (every field but the scalar `temperature` has a row per completion).

    Attributes:
      tokens: `[B, N]` completion token ids, `pad_token` after each completion ends.
      where: `[B, N]` True on the completion's tokens, up to and including its first stop
        token; False after it.
      logps: `[B, N]` float32 behaviour log-probs of the sampled tokens (see
        `SamplingConfig.logps_of`), 0 outside `where`.
      lengths: `[B]` tokens per completion, `where.sum(-1)`.
      truncated: `[B]` True where the completion reached `max_new_tokens` without a stop
        token.
      temperature: float32 scalar, the temperature $\\tau$ of the distribution `logps` come
        from, so that a trainer recomputes them with `temperature=rollout.temperature`
        (`tunelib.logprobs.token_logps`) without carrying the `SamplingConfig` around: the
        config's temperature, or 1.0 for greedy decoding (temperature 0), whose log-probs are
        those of the untempered distribution.
      routing: with `sample(..., record_routing=True)`, the `[B, P + N, M, k]` int32 experts
        each token was routed to in each of the model's M mixture-of-experts layers, over
        the prompt and the completion concatenated: columns `[0, P)` are the prompt (its
        prefill, the same for the G completions of a prompt), column `P + j` is completion
        token j (as the decode step that fed it back chose). Rows first, as every other
        field, so it is sliced and sharded by row alike; the decoder's own layout,
        `Decoder(..., routing=)`, is layer-first `[M, B, T, k]`, as its router logits.
        Padded positions hold valid ids that no real token depends on.
        `tunelib.rollout.completion_logps(..., routing=rollout.routing)` routes the trainer's
        forward pass by it (routing replay, R3). None (the default) when not recorded.
      policy_version: int32 scalar, the policy version `sample` was given
        (`policy_version=`), or None when it was given none.
      fingerprint: uint32 scalar, `tunelib.rollout.fingerprint` of the parameters the
        sampler ran, with `policy_version` (None without it). A trainer checks the pair with
        `tunelib.rollout.PolicyLedger.check`.
      token_versions: `[B, N]` int32, the policy version that drew each token, for a
        rollout sampled a segment at a time with new weights between segments
        (`tunelib.rollout.continue_rollout`; 0 outside `where`); None from `sample`, whose
        tokens are all `policy_version`'s.
    """

    tokens: Int[Array, "B N"]
    where: Bool[Array, "B N"]
    logps: Float[Array, "B N"]
    lengths: Int[Array, " B"]
    truncated: Bool[Array, " B"]
    temperature: Float[Array, ""]
    routing: Int[Array, "B T M k"] | None = None
    policy_version: Int[Array, ""] | None = None
    fingerprint: UInt32[Array, ""] | None = None
    token_versions: Int[Array, "B N"] | None = None

    def decode(self, tokenizer: Tokenizer) -> list[str]:
        """The text of each completion: its tokens inside `where`, decoded by `tokenizer`.

        Only real tokens are decoded (the padding after a completion is not), and the
        tokenizer skips its special tokens, the stop token among them. Runs on the host
        (not under `jax.jit`); row `b * G + g` of the result is completion g of prompt b, as
        in the rollout.

        Args:
          tokenizer: the `tunelib.data.Tokenizer` the prompts were encoded with.

        Returns:
          `B` strings, one per completion.

        Examples:
          >>> import jax.numpy as jnp
          >>> from tunelib.data import CharTokenizer
          >>> from tunelib.rollout import Rollout
          >>> tok = CharTokenizer()
          >>> tokens = jnp.array([tok.encode("42") + [tok.eos_id, 0], tok.encode("7+1=")])
          >>> where = jnp.array([[True, True, True, False], [True] * 4])
          >>> out = Rollout(tokens, where, jnp.zeros((2, 4)), where.sum(-1),
          ...               jnp.array([False, True]), jnp.float32(1.0))
          >>> out.decode(tok)
          ['42', '7+1=']
        """
        tokens, where = np.asarray(self.tokens), np.asarray(self.where, bool)
        return [tokenizer.decode(row[keep]) for row, keep in zip(tokens, where, strict=True)]


def sample(
    graphdef: nnx.GraphDef,
    params: PyTree,
    prompt_tokens: Int[ArrayLike, "B P"],
    prompt_where: Bool[ArrayLike, "B P"],
    key: jax.Array,
    config: SamplingConfig,
    *,
    group_size: int = 1,
    record_routing: bool = False,
    policy_version: int | ArrayLike | None = None,
    layout: Layout = "stacked",
    products: Products = "blocked",
    windowed_cache: bool = True,
    images: Mapping[str, ArrayLike] | None = None,
) -> Rollout:
    r"""Sample completions of prompts with a KV cache: prefill once, then decode a token a step.

    The prompts are prefilled in one forward pass (`Decoder.extend`); then each step draws
    a token per row from the processed distribution of the last logits,

    $$
    y_t \sim \mathrm{softmax}\big(\mathrm{filters}(\ell_t / \tau)\big), \qquad
    \text{or } y_t = \arg\max_v \ell_{t,v} \text{ when } \tau = 0,
    $$

    records its log-prob, and feeds it back through the cache, inside one `lax.while_loop`
    that ends as soon as every row has produced a stop token (or after `max_new_tokens`).
    The filters are `tunelib.rollout.process_logits` (forbidden tokens, then top-k, top-p,
    min-p on the tempered logits). Step $t$ draws with `jax.random.fold_in(key, t)`, each row
    independently: the same key reproduces a call exactly, different keys give different
    samples.

    With `group_size` G, each prompt is prefilled once and its cache copied G ways, so the
    G completions of a prompt share one prefill and differ only by their draws; row
    `b * G + g` of the result is completion g of prompt b (the flat layout that
    `tunelib.advantages.group_advantages(rewards, group_size=G)` takes).

    Prompts may be padded on either side: positions and attention follow
    `prompt_where`, and decoding continues from each row's last real token. Every prompt
    needs at least one real token.

    Args:
      graphdef: the `nnx.GraphDef` of a `tunelib.models.Decoder` or
        `tunelib.models.VisionLanguageModel` (static).
      params: its parameters (an `nnx.State` or the pure dict of one), possibly sharded; or
        a base with LoRA adapters, `tunelib.peft.apply_lora(base, adapters)`, the base float
        or quantised (`peft.quantize_params`, `peft.gguf_base`): the program then runs
        through `peft.lora`, products compute $xW + s\,(xA)B$ and no dense copy of a weight
        is formed.
      prompt_tokens: `[B, P]` prompt token ids.
      prompt_where: `[B, P]` True on real prompt tokens.
      key: a PRNG key (new-style `jax.random.key` or legacy uint32).
      config: a `SamplingConfig` (static).
      group_size: completions per prompt, G >= 1.
      record_routing: record the experts every prompt and completion token was routed to
        in each mixture-of-experts layer, as `Rollout.routing` (static; default False), for
        routing replay (R3) in the trainer's recomputation: in bfloat16 the cached decode
        step and the trainer's full forward pass round differently and can choose different
        experts where two are near a tie, which makes their log-probs differ.
      policy_version: the version of the policy `params` are (an int >= 0, such as the
        number of updates behind them), or None. Given, the `Rollout` is stamped with it and
        with `tunelib.rollout.fingerprint(params)`, the fingerprint of the parameters the
        sampler actually ran (one more read of them), for a trainer's `PolicyLedger.check`.
      layout: how the program reads a stacked model's layers (`scan_layers=True`):
        ``"stacked"`` (default), the scan over the `[L, ...]` stacks, which on XLA copies each
        layer's weights out of the stacks at every decode step; or ``"per_layer"``, the
        weights in `Decoder.decoding_layout` (one array per layer, copied once per call),
        read in place. Same tokens and log-probs, bit for bit. ``"per_layer"`` makes each
        decode step faster (1.2 to 1.9x on SmolLM2 on CPU, `benchmarks/decode_floor.py`) but
        compiles longer (1.5 to 1.8x the scan's, more on a first compile) and holds the dense
        layer weights twice during the call: worth it on CPU for many decode steps, such as
        an RL run's rollouts, not for one short generation; on a GPU it is slower (0.6x the
        stacked speed on an H200, its `lax.switch` branches costing more than the copies
        they save). Adapted or quantised parameters (run
        through `peft.lora`) always run the scan.
      products: how float32 products add up on CPU: ``"blocked"`` (default), as
        `tunelib.models.Dense` computes them everywhere (sums over blocks of at most 192
        input features, whose rounding is as small as PyTorch's: the trainer's own
        numerics); or ``"plain"``, one dot over all the inputs, which XLA's CPU dot runs
        much faster once many rows are decoded at once (SmolLM2-135M at batch 32: decode
        steps 1.0 to 1.55x faster in five runs on two CPUs, `docs/rollout.md`) and which rounds
        as XLA's dot does (float32 logits 1.2 to 3.9 times as far from float64 ones on
        SmolLM2, `docs/models.md`), so that greedy ties and behaviour log-probs differ from
        the blocked ones in about the fifth decimal. Other dtypes, other backends, and
        adapted or quantised parameters (always plain) are the same either way.
      windowed_cache: sliding-window layers (Gemma 2, 3, 4, Mistral) keep only their
        window in the KV cache, a ring of $W$ slots (`Decoder.init_cache(...,
        windowed=True)`), instead of every slot: the same keys attended with the same
        weights, so the same tokens and log-probs up to float32 rounding (the attention's
        sums run over the ring in another order: about 1e-6 in the hidden states, 1e-12
        in float64). Default True; False keeps every slot, bit for bit as before
        (`benchmarks/windowed_cache.py` compares the two). A model without sliding layers,
        or a cache no longer than the window, is the same either way.
      images: for a `tunelib.models.VisionLanguageModel`, the images of the prompts as
        the model's preprocessing returns them (`image_inputs`: Gemma 4's `pixel_values`
        and `image_position_ids` from `tunelib.data.gemma4_image_inputs`, Qwen3.5's
        `pixel_values` and `image_grid_thw` from `tunelib.data.qwen_vl_image_inputs`; in
        the order their image tokens appear, prompt by prompt).
        They are encoded once, in the prefill; with `group_size` G the prefilled cache,
        images included, is copied G ways like the text. None: text only.

    Returns:
      A `Rollout` of `B * G` completions of `config.max_new_tokens` slots.

    Raises:
      ValueError: before compiling, for a config the vocabulary cannot satisfy (stop,
        forbidden or pad ids out of range, every token forbidden; the rest of the config is
        checked when it is made), a prompt longer than the cache, an empty prompt or a prompt
        token id outside the vocabulary (both checked when the prompts are concrete, not
        traced), a bad `group_size`, `record_routing` for a model without
        mixture-of-experts layers, or `images` for a model that reads none (or without
        the arrays it reads, or with `num_soft_tokens_per_image` that
        the prompts' image tokens do not add up to, when the prompts are concrete).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from tunelib.models import Decoder, DecoderConfig
      >>> from tunelib.rollout import SamplingConfig, sample
      >>> cfg = DecoderConfig(vocab_size=16, hidden_size=32, intermediate_size=64,
      ...                     num_hidden_layers=1, num_attention_heads=2, head_dim=16)
      >>> graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
      >>> prompts = jnp.array([[0, 3, 4], [5, 6, 7]])
      >>> where = jnp.array([[False, True, True], [True, True, True]])  # left-padded
      >>> config = SamplingConfig(max_new_tokens=6, temperature=0.8, top_p=0.9,
      ...                         stop_tokens=(2,))
      >>> out = sample(graphdef, params, prompts, where, jax.random.key(0), config,
      ...              group_size=3)
      >>> print(out.tokens.shape, out.lengths.shape)
      (6, 6) (6,)
      >>> bool((out.lengths == out.where.sum(-1)).all())
      True

    References:
      Holtzman et al., "The Curious Case of Neural Text Degeneration" (top-p), 2020,
      https://arxiv.org/abs/1904.09751.
      Pope et al., "Efficiently Scaling Transformer Inference" (KV caching), 2022,
      https://arxiv.org/abs/2211.05102.
      Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
      Routers" (R3, `record_routing`), 2025, https://arxiv.org/abs/2510.11370.
    """
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}.")
    check_version(policy_version)
    v.one_of(layout, "layout", LAYOUTS)
    v.one_of(products, "products", PRODUCTS)
    if not isinstance(windowed_cache, bool):
        raise TypeError(f"windowed_cache must be a bool, got {windowed_cache!r}.")
    prompt_tokens, prompt_where, model_config = checked_prompts(
        graphdef, params, prompt_tokens, prompt_where, config, group_size
    )
    images = checked_images(graphdef, params, images, prompt_tokens, prompt_where)
    check_record_routing(record_routing, model_config)
    prompt_len = prompt_tokens.shape[1]
    needed = prompt_len + config.max_new_tokens
    if config.cache_length is not None and config.cache_length < needed:
        raise ValueError(
            f"prompts of {prompt_len} positions plus max_new_tokens={config.max_new_tokens} "
            f"need {needed} cache slots, but cache_length is {config.cache_length}."
        )
    given, params = params, decoding_params(graphdef, params, layout)
    with products_context(products):
        out = _sample(graphdef, params, prompt_tokens, prompt_where, key, config, group_size,
                      record_routing, windowed_cache, images)  # fmt: skip
    return out if policy_version is None else out._replace(**stamp(given, policy_version))


@program(static_argnums=(0, 5, 6, 7, 8))
def _sample(
    graphdef,
    params,
    prompt_tokens,
    prompt_where,
    key,
    config,
    group_size,
    record_routing,
    windowed,
    images,
):
    """`sample` after its checks: a prefill and one decode loop, in one program."""
    params = pure_params(params)
    cache_length = config.cache_length or prompt_tokens.shape[1] + config.max_new_tokens
    logits, cache, *routing = prefill(
        graphdef,
        params,
        prompt_tokens,
        prompt_where,
        cache_length,
        group_size,
        windowed=windowed,
        record_routing=record_routing,
        images=images,
    )
    out = decode(
        graphdef, params, logits, cache, as_key(key), config, record_routing=record_routing
    )
    temperature = jnp.asarray(config.temperature or 1.0, jnp.float32)
    lengths = out.where.sum(-1, dtype=jnp.int32)
    if record_routing:  # the prompt's columns, then the completion's; rows first
        routing = rearrange(
            jnp.concatenate([routing[0], out.routing], axis=2), "m r t k -> r t m k"
        )
    else:
        routing = None
    return Rollout(out.tokens, out.where, out.logps, lengths, ~out.done, temperature, routing)
