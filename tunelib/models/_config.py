"""The decoder configuration, named after the fields of a Hugging Face `config.json`."""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from tunelib.models._deepseek_config import (
    check_mla,
    check_positive_float,
    check_positive_int,
    check_sigmoid_routing,
)
from tunelib.models._layer_runs import LayerRun, layer_runs
from tunelib.models._rope import checked_rope_scaling

DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64")
HIDDEN_ACTS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention", "linear_attention")


class Dtypes:
    """`compute_dtype` and `storage_dtype` of a config's `dtype` and `param_dtype` names."""

    dtype: str
    param_dtype: str

    @property
    def compute_dtype(self) -> jnp.dtype:
        """`dtype` as a NumPy dtype."""
        return jnp.dtype(self.dtype)

    @property
    def storage_dtype(self) -> jnp.dtype:
        """`param_dtype` as a NumPy dtype."""
        return jnp.dtype(self.param_dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig(Dtypes):
    r"""Hyperparameters of a Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mistral / Gemma 2, 3, 4 /
    gpt-oss / DeepSeek-V3 / Qwen3.5 decoder.

    Fields named as in a Hugging Face `config.json` mean what they mean there, so a config can
    be built with `DecoderConfig(**{k: hf[k] for k in names})`. Every field is checked on
    construction; an invalid value raises a `ValueError` (a `TypeError` for a wrong type)
    that names the field.

    Attributes:
      vocab_size: $V$, rows of the token embedding.
      hidden_size: $H$, width of the residual stream.
      intermediate_size: $F$, width of the SwiGLU MLP.
      num_hidden_layers: $L$, number of decoder layers.
      num_attention_heads: $N$, query heads.
      num_key_value_heads: $K$, key/value heads (grouped-query attention); $N$ must be a
        multiple of $K$. None means $K = N$ (multi-head attention), as in Hugging Face.
      head_dim: $D$, width of one head (even, for RoPE). None means $H / N$, as in Hugging
        Face; Qwen3 sets it explicitly ($N D \ne H$ is allowed).
      rms_norm_eps: $\epsilon$ of every RMSNorm.
      rope_theta: base $\theta$ of the rotary frequencies.
      rope_scaling: None (plain RoPE), `{"rope_type": "linear", "factor": s}` (position
        interpolation: every frequency divided by $s$), or Llama 3.1's
        `{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings"}`, or Gemma 4's `{"rope_type": "proportional",
        "factor", "partial_rotary_factor"}` (only the first `partial_rotary_factor` of each
        head's channel pairs rotate), or YaRN's `{"rope_type": "yarn", "factor",
        "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate",
        "attention_factor"}` (gpt-oss; `cos` and `sin` are also multiplied by
        `attention_factor`; it may also carry `"mscale_all_dim"` $a$, which multiplies the
        softmax scale of multi-head latent attention by $m(s, a)^2$, $m(s, a) = 0.1\, a \ln s
        + 1$, as DeepSeek-V3 does). The legacy key `"type"` is read as `"rope_type"`. See
        `tunelib.models.rope_frequencies`.
      max_position_embeddings: the context length the checkpoint was trained for; kept for
        round-tripping `config.json`, the forward pass does not read it.
      tie_word_embeddings: whether the unembedding is the transposed token embedding (no
        separate `lm_head`).
      attention_bias: whether the q/k/v projections have biases (Qwen2 always; Llama and
        Qwen3 with their `attention_bias`, which also sets `o_proj_bias`).
      o_proj_bias: ours: whether the attention output projection has a bias (Hugging Face's
        Llama and Qwen3 give it one exactly when `attention_bias`; Qwen2 never).
      mlp_bias: whether the gate, up and down projections of the MLP have biases (Llama).
      sliding_window: None (full causal attention) or $W$: query $t$ sees only the keys at
        slots $s$ with $t - W < s \le t$, itself and the $W - 1$ slots before it (Mistral;
        Qwen2 and Qwen3 when every layer slides). Slots are columns of the input (or of the
        KV cache), padding included, as in Hugging Face.
      layer_types: None, or for each layer "full_attention", "sliding_attention" (Gemma 3
        interleaves five sliding layers with one full one) or "linear_attention" (a Gated
        DeltaNet layer, Qwen3.5: `tunelib.models.GatedDeltaNet`); `sliding_window` is the
        window of the sliding ones. None means every layer slides when `sliding_window` is
        set.
      rope_local_base_freq: $\theta$ of the sliding layers' RoPE (unscaled), Gemma 3's local
        base frequency; None means they rotate as the full layers do (`rope_theta`,
        `rope_scaling`).
      hidden_act: the MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU
        with the tanh approximation, Gemma).
      query_pre_attn_scalar: attention scores are scaled by this to the power $-1/2$
        (Gemma); None means `head_dim`.
      attn_logit_softcapping: None, or $c$: scaled scores become $c \tanh(s / c)$ before the
        mask and the softmax (Gemma 2).
      final_logit_softcapping: None, or $c$: the logits are $c \tanh(l / c)$ (Gemma 2 and
        3 configs; `Decoder.unembed` applies it, and the fused heads take it as `softcap`).
      norm_offset: ours (Gemma): every RMSNorm scales by $(1 + g)$, multiplied in float32
        before the cast to the compute dtype, with $g$ initialised to 0.
      sandwich_norms: ours (Gemma 2 and 3): the attention and MLP outputs are normalised too
        (`post_attention_layernorm`, `post_feedforward_layernorm`) before each residual
        addition, and the MLP's input by `pre_feedforward_layernorm`.
      scale_embeddings: ours (Gemma): the token embeddings are multiplied by
        $\sqrt{H}$ (rounded to the parameter dtype) before the first layer.
      initializer_range: standard deviation of the normal initialisation of every matmul
        kernel and the embedding.
      use_qk_norm: ours (Qwen3 has it, with no `config.json` flag): an RMSNorm over
        `head_dim` applied to every query and key head before RoPE.
      num_experts: $E$, experts of each mixture-of-experts layer; 0 (the default) means
        every layer has the dense MLP. See `tunelib.models.MoE`.
      num_experts_per_tok: $k$, experts each token is routed to ($1 \le k \le E$).
      moe_intermediate_size: width of each expert's SwiGLU MLP; None means
        `intermediate_size`.
      norm_topk_prob: whether the $k$ chosen routing probabilities are renormalised to sum
        to 1 (Qwen3-MoE's flag; its default is False, Mixtral's behaviour is True).
      decoder_sparse_step: layer $l$ (from 0) is a mixture of experts when
        $(l + 1) \bmod$ `decoder_sparse_step` $= 0$ and $l$ is not in `mlp_only_layers`.
      mlp_only_layers: indices of the layers that keep the dense MLP (width
        `intermediate_size`) in a mixture-of-experts model.
      global_head_dim: Gemma 4: the head width of the full-attention layers; None means
        `head_dim`. Their RoPE (`rope_theta`, `rope_scaling`) is computed for this width.
      num_global_key_value_heads: Gemma 4: the key/value heads of the full-attention
        layers; None means `num_key_value_heads`.
      attention_k_eq_v: Gemma 4: the full-attention layers have no `v_proj`; their values
        are the key projection's output (before the key norm and RoPE).
      value_norm: ours (Gemma 4): values are RMS-normalised over the head, with no learned
        scale.
      num_kv_shared_layers: Gemma 4: the last this many layers compute no keys or values;
        each attends over those of the last earlier layer of its own type (and, with a
        cache, writes none).
      use_double_wide_mlp: Gemma 4: the KV-shared layers' MLPs are twice
        `intermediate_size` wide.
      hidden_size_per_layer_input: Gemma 4's per-layer inputs: 0 (none) or $P$. Each token
        then has, for every layer $l$, a $P$-wide input
        $q_l = (\mathrm{RMSNorm}(x W_p / \sqrt{H})_l + \sqrt{P}\, E^{(p)}_{x,l}) / \sqrt 2$
        from a second embedding $E^{(p)}$ `[V_p, L P]` and a projection $W_p$ `[H, L P]` of
        the (scaled) token embedding $x$; layer $l$ ends with
        $h \leftarrow h + \mathrm{RMSNorm}(W_o(\phi(h W_g) \odot q_l))$.
      vocab_size_per_layer_input: $V_p$, rows of the per-layer embedding; None means
        `vocab_size` (the only value supported, since every token needs a row).
      parallel_moe: ours (Gemma 4's `enable_moe_block`): every layer keeps its dense MLP
        and adds a mixture of experts beside it, each output normalised, with Gemma 4's
        router (`tunelib.models.MoE`); False is Qwen3-MoE's layout, where the experts
        replace the MLP.
      layer_scalars: ours (Gemma 4): each layer's output is multiplied by a stored constant
        `layer_scalar` (a Hugging Face buffer: it receives no gradient).
      attention_sinks: ours (gpt-oss): every query head $n$ has a learned logit $a_n$
        (`self_attn/sinks`, `[N]`) that joins the softmax's denominator and attends to
        nothing: $p_s = e^{z_s} / (e^{a_n} + \sum_{s'} e^{z_{s'}})$, so a head may attend
        to less than one token's worth of values.
      biased_experts: ours (gpt-oss's MoE block): the router has a bias and each expert's
        fused `gate_up_proj` (gate and up columns interleaved) and `down_proj` have biases;
        the experts apply the clamped SwiGLU of `swiglu_alpha` and `swiglu_limit`, and the
        top-$k$ weights are a softmax over the chosen logits (`norm_topk_prob` must be
        True). See `tunelib.models.MoE` and `docs/models.md`.
      swiglu_alpha: $\alpha$ of the clamped SwiGLU (gpt-oss: 1.702); set exactly when
        `biased_experts`.
      swiglu_limit: $c$ of the clamped SwiGLU (gpt-oss: 7.0): the gate is clipped above at
        $c$, the up projection to $[-c, c]$, and the expert computes
        $(\mathrm{up} + 1) \cdot g\,\sigma(\alpha g)$; set exactly when `biased_experts`.
      kv_lora_rank: DeepSeek-V3: None (ordinary attention), or $r$: multi-head latent
        attention (`tunelib.models` MLA, `docs/models.md`). Keys and values come from an
        $r$-wide latent $c = \mathrm{RMSNorm}(x W_{DKV})$ (`kv_a_proj_with_mqa`,
        `kv_a_layernorm`) through `kv_b_proj`, plus one `head_dim`-wide rotated key shared by
        every head; `head_dim` is then the rotary width (transformers' `qk_rope_head_dim`),
        `num_key_value_heads` must equal `num_attention_heads`, and a KV cache holds the
        latent and the rotated key, $r + D$ values per token and layer.
      q_lora_rank: DeepSeek-V3's query compression: None (one `q_proj`) or the width of the
        `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` path; only with `kv_lora_rank`.
      qk_nope_head_dim: DeepSeek-V3: the width of each query and key head's part without
        RoPE (0 without `kv_lora_rank`); a head's query and key are
        `qk_nope_head_dim + head_dim` wide.
      v_head_dim: DeepSeek-V3: the width of each value head; None without `kv_lora_rank`.
      rope_interleave: DeepSeek-V3: the rotary channels form the pairs $(0, 1), (2, 3),
        \dots$ instead of $(i, i + D/2)$, as transformers' `rope_interleave`.
      n_shared_experts: DeepSeek-V3: a dense SwiGLU of `n_shared_experts *
        moe_intermediate_size` beside the routed experts of every mixture-of-experts layer
        (`mlp/shared_experts`); needs `scoring_func="sigmoid"`.
      scoring_func: the router's scores: "softmax" (Qwen3-MoE, gpt-oss, Gemma 4) or
        "sigmoid" (DeepSeek-V3: sigmoid scores, experts chosen on the scores plus the
        `e_score_correction_bias`, group-limited top-k; see `tunelib.models.route_grouped`).
      n_group: DeepSeek-V3: the experts form this many groups of equal size, at least 2
        experts each; only with `scoring_func="sigmoid"`.
      topk_group: DeepSeek-V3: each token chooses its experts among the `topk_group` groups
        of highest score (each group's score is the sum of its two best).
      routed_scaling_factor: DeepSeek-V3: the routed experts' weights are multiplied by it
        (1 for the other families).
      shared_expert_intermediate_size: Qwen3.5-MoE: 0 (none) or the width $F_s$ of a shared
        SwiGLU expert beside the routed ones in every mixture-of-experts layer, its output
        scaled by $\sigma(x w_{sg})$ (`shared_expert_gate`, `[H, 1]`) before it is added.
      attention_output_gate: ours (Qwen3.5): `q_proj` also gives, per head, a gate $g$ of
        the head's width, and the attention output is multiplied by $\sigma(g)$ before
        `o_proj` (Hugging Face's `q_proj` rows alternate per head: $D$ query rows, then
        $D$ gate rows).
      partial_rotary_factor: $p$, the fraction of each head's channels that RoPE rotates
        (Qwen3.5: 0.25): the first $r = \lfloor p D \rfloor$ channels, in pairs
        $(i, i + r/2)$, with the frequencies of a head of width $r$; the others pass. 1.0
        (the default) rotates every channel.
      mrope_section: Qwen3.5's multimodal RoPE: None (plain RoPE), or $(s_t, s_h, s_w)$:
        positions may then be `[3, B, T]` (temporal, height, width; `mrope_positions`), and
        rotary pair $i$ turns by the height position where $i \bmod 3 = 1$ and $i < 3 s_h$,
        by the width position where $i \bmod 3 = 2$ and $i < 3 s_w$, and by the temporal
        one elsewhere (transformers' interleaved layout; its `mrope_interleaved` is not
        read, as there). Text positions are equal on the three axes, so `[B, T]` positions
        rotate as plain RoPE does.
      linear_conv_kernel_dim: $K_c$, the taps of the Gated DeltaNet layers' causal
        depthwise convolution (Qwen3.5: 4).
      linear_key_head_dim: $d_k$, the width of a Gated DeltaNet query/key head.
      linear_value_head_dim: $d_v$, the width of a Gated DeltaNet value head.
      linear_num_key_heads: $h_k$, the Gated DeltaNet query/key heads.
      linear_num_value_heads: $h_v$, the Gated DeltaNet value heads (a multiple of $h_k$;
        value head $j$ reads query/key head $\lfloor j h_k / h_v \rfloor$).
      linear_chunk_size: ours: the chunk length $C$ of the Gated DeltaNet's chunked
        parallel form (`tunelib.models.chunked_gated_delta_rule`); it changes the order of
        float32 sums, not the result (Hugging Face: 64).
      scan_layers: ours: store the layers stacked on a leading "layers" axis and run them
        with `nnx.scan` (one compiled layer instead of $L$). Layers of several shapes
        (Gemma 4's sliding and full layers, dense and mixture-of-experts layers) are scanned
        by groups: a repeated pattern of $p$ layers keeps one stack per position and is one
        scan whose body runs the $p$ layers (`layer_runs`); a fixed number of layer bodies is
        compiled, whatever the depth. Not with Gated DeltaNet layers,
        `num_kv_shared_layers` or `hidden_size_per_layer_input`.
      scan_unroll: ours: with `scan_layers`, how many steps of the layers' scan run as one
        step of its loop (`jax.lax.scan`'s `unroll`): 1 (the default) compiles one body of
        the scanned layers; $k$ compiles $k$ copies, which XLA can fuse and overlap across,
        for a longer compilation. The parameters, their layout and the computed values are
        the same. On CPU, XLA runs a loop's steps one after another: a GRPO update of a
        4-layer model took 0.386 s instead of 0.459 s with `scan_unroll=4`, as fast as
        unrolled layers (`benchmarks/README.md`, `shared_prompts.py`). On a TPU v5e, with
        SmolLM2-135M's 30 layers in bfloat16, 1 is the fastest short of unrolling every
        layer: the train step took 44.0 ms at 1, 66.6-87.6 ms at 2-10 and 40.4 ms at 30 (for
        106 s of compilation against 7.0 s), the sampler 106 ms at 1 and 112-122 ms at the
        others (`benchmarks/scan_unroll.py`).
      remat: ours: recompute each layer's activations in the backward pass (`nnx.remat`).
      dtype: ours: the compute dtype of matmuls and the residual stream, one of
        "float32", "bfloat16", "float16", "float64". RMSNorm statistics, RoPE and softmax
        run in at least float32 whatever this is.
      param_dtype: ours: the storage dtype of the weights (same choices).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float | int = 1e-6
    rope_theta: float | int = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    initializer_range: float | int = 0.02
    use_qk_norm: bool = False
    layer_types: Sequence[str] | None = None
    rope_local_base_freq: float | int | None = None
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | int | None = None
    attn_logit_softcapping: float | int | None = None
    final_logit_softcapping: float | int | None = None
    norm_offset: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: Sequence[int] = ()
    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None
    attention_k_eq_v: bool = False
    value_norm: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int | None = None
    parallel_moe: bool = False
    layer_scalars: bool = False
    attention_sinks: bool = False
    biased_experts: bool = False
    swiglu_alpha: float | int | None = None
    swiglu_limit: float | int | None = None
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int | None = None
    rope_interleave: bool = False
    n_shared_experts: int = 0
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float | int = 1.0
    shared_expert_intermediate_size: int = 0
    attention_output_gate: bool = False
    partial_rotary_factor: float | int = 1.0
    mrope_section: tuple[int, int, int] | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_chunk_size: int = 64
    scan_layers: bool = False
    scan_unroll: int = 1
    remat: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "scan_unroll",
        ):
            check_positive_int(getattr(self, name), name)
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        check_positive_int(self.num_key_value_heads, "num_key_value_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"head_dim is None, so hidden_size ({self.hidden_size}) must be a "
                    f"multiple of num_attention_heads ({self.num_attention_heads})."
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        check_positive_int(self.head_dim, "head_dim")
        if self.sliding_window is not None:
            check_positive_int(self.sliding_window, "sliding_window")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}.")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            check_positive_float(getattr(self, name), name)
        for name in (
            "tie_word_embeddings",
            "attention_bias",
            "o_proj_bias",
            "mlp_bias",
            "use_qk_norm",
            "norm_offset",
            "sandwich_norms",
            "scale_embeddings",
            "norm_topk_prob",
            "attention_k_eq_v",
            "value_norm",
            "use_double_wide_mlp",
            "parallel_moe",
            "layer_scalars",
            "attention_sinks",
            "biased_experts",
            "rope_interleave",
            "attention_output_gate",
            "scan_layers",
            "remat",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        for name in ("dtype", "param_dtype"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a dtype name, got {getattr(self, name)!r}.")
            if getattr(self, name) not in DTYPE_NAMES:
                raise ValueError(
                    f"{name} must be one of {DTYPE_NAMES}, got {getattr(self, name)!r}."
                )
        object.__setattr__(self, "rope_scaling", checked_rope_scaling(self.rope_scaling))
        self._check_mrope()
        self._check_experts()
        self._check_layer_types()
        self._check_gemma4()
        self._check_biased_experts()
        check_mla(self)
        check_sigmoid_routing(self)
        self._check_linear_attention()
        self._check_shared_expert()

    def _check_shared_expert(self) -> None:
        width = self.shared_expert_intermediate_size
        if isinstance(width, bool) or not isinstance(width, int) or width < 0:
            raise ValueError(f"shared_expert_intermediate_size must be an int >= 0, got {width!r}.")
        if width and (not self.num_experts or self.parallel_moe or self.biased_experts):
            raise ValueError(
                "shared_expert_intermediate_size needs num_experts > 0, parallel_moe=False and "
                "biased_experts=False (Qwen3.5-MoE's experts)."
            )

    def _check_linear_attention(self) -> None:
        for name in (
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_chunk_size",
        ):
            check_positive_int(getattr(self, name), name)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})."
            )
        if any(self.linear_layers) and self.num_kv_shared_layers:
            raise ValueError(
                "num_kv_shared_layers must be 0 when layer_types has 'linear_attention' layers."
            )
        if any(self.linear_layers) and self.scan_layers:
            raise ValueError(
                "scan_layers does not support layer_types with 'linear_attention' layers; use "
                "scan_layers=False."
            )
        partial = self.partial_rotary_factor
        check_positive_float(partial, "partial_rotary_factor")
        if partial > 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor ({partial}) must be in (0, 1] and rotate an even number "
                f"of channels of head_dim {self.head_dim}, got {self.rotary_dim}."
            )
        if partial != 1 and self.rope_scaling and self.rope_scaling["rope_type"] == "proportional":
            raise ValueError(
                "partial_rotary_factor must be 1 with the proportional RoPE of rope_scaling, "
                "which has its own partial_rotary_factor."
            )
        if partial != 1 and self.global_head_dim is not None:
            raise ValueError("partial_rotary_factor must be 1 when global_head_dim is set.")

    @property
    def rotary_dim(self) -> int:
        """The channels of each head that RoPE rotates: `partial_rotary_factor` of
        `head_dim`, rounded down."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> tuple[bool, ...]:
        """For each layer, whether it is a Gated DeltaNet (`"linear_attention"`) layer."""
        if self.layer_types is None:
            return (False,) * self.num_hidden_layers
        return tuple(t == "linear_attention" for t in self.layer_types)

    @property
    def layer_cache_widths(self) -> tuple[tuple[int, int, int], ...]:
        """For each layer, what its KV cache holds per slot: `(heads, key width, value
        width)`; for multi-head latent attention one latent of `kv_lora_rank + head_dim`
        and no separate values (they are the latent's first `kv_lora_rank` channels)."""
        if self.kv_lora_rank is not None:
            return ((1, self.kv_lora_rank + self.head_dim, 0),) * self.num_hidden_layers
        return tuple(
            (k, d, d) for k, d in zip(self.layer_kv_heads, self.layer_head_dims, strict=True)
        )

    def _check_biased_experts(self) -> None:
        clamp = (self.swiglu_alpha, self.swiglu_limit)
        for name, value in zip(("swiglu_alpha", "swiglu_limit"), clamp, strict=True):
            if value is not None:
                check_positive_float(value, name)
        if not self.biased_experts:
            if clamp != (None, None):
                raise ValueError(
                    "swiglu_alpha and swiglu_limit are the clamped SwiGLU of biased_experts "
                    f"(gpt-oss), which is False here; got {clamp}."
                )
            return
        if not self.num_experts or self.parallel_moe:
            raise ValueError("biased_experts needs num_experts > 0 and parallel_moe=False.")
        if None in clamp:
            raise ValueError(
                f"biased_experts needs swiglu_alpha and swiglu_limit set, got {clamp}."
            )
        if not self.norm_topk_prob:
            raise ValueError(
                "biased_experts routes by a softmax over the chosen logits, which is "
                "norm_topk_prob=True; got norm_topk_prob=False."
            )

    def _check_layer_types(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}.")
        for name in (
            "rope_local_base_freq",
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
        ):
            if getattr(self, name) is not None:
                check_positive_float(getattr(self, name), name)
        types = self.layer_types
        if types is None:
            return
        if isinstance(types, str) or len(types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types must list one type for each of the {self.num_hidden_layers} "
                f"layers, got {types!r}."
            )
        types = tuple(types)
        if set(types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types may only hold {LAYER_TYPES}, got {list(types)}.")
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError("layer_types has sliding layers, so sliding_window must be set.")
        object.__setattr__(self, "layer_types", types)

    def _check_gemma4(self) -> None:
        for name in ("global_head_dim", "num_global_key_value_heads"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)
        if self.global_head_dim is not None and self.global_head_dim % 2:
            raise ValueError(f"global_head_dim must be even for RoPE, got {self.global_head_dim}.")
        global_kv = self.num_global_key_value_heads
        if global_kv is not None and self.num_attention_heads % global_kv:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_global_key_value_heads ({global_kv})."
            )
        for name in ("num_kv_shared_layers", "hidden_size_per_layer_input"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}.")
        if self.vocab_size_per_layer_input is None:
            object.__setattr__(self, "vocab_size_per_layer_input", self.vocab_size)
        if self.vocab_size_per_layer_input != self.vocab_size:
            raise ValueError(
                f"vocab_size_per_layer_input ({self.vocab_size_per_layer_input!r}) must equal "
                f"vocab_size ({self.vocab_size}): every token needs a per-layer input row."
            )
        shared = self.num_kv_shared_layers
        if shared >= self.num_hidden_layers:
            raise ValueError(
                f"num_kv_shared_layers ({shared}) must be < num_hidden_layers "
                f"({self.num_hidden_layers}): some layer has to compute the keys and values."
            )
        first = self.num_hidden_layers - shared
        kinds = self.sliding_layers
        for i in range(first, self.num_hidden_layers):
            if kinds[i] not in kinds[:first]:
                kind = "sliding" if kinds[i] else "full"
                raise ValueError(
                    f"num_kv_shared_layers={shared}: layer {i} is a {kind}-attention layer "
                    f"that shares keys and values, but none of the first {first} layers is one."
                )
        if self.parallel_moe and not self.num_experts:
            raise ValueError("parallel_moe needs num_experts > 0.")
        if self.scan_layers and self.num_kv_shared_layers:
            raise ValueError(
                "scan_layers does not support num_kv_shared_layers > 0 (layers attending over "
                "another layer's keys and values); use scan_layers=False."
            )
        if self.scan_layers and self.hidden_size_per_layer_input:
            raise ValueError("scan_layers does not support hidden_size_per_layer_input > 0.")

    @property
    def stackable(self) -> bool:
        """Whether the layers can be stacked (`scan_layers=True`, by groups where their
        shapes differ): no Gated DeltaNet layers, shared keys and values or per-layer
        inputs."""
        return not (
            any(self.linear_layers) or self.num_kv_shared_layers or self.hidden_size_per_layer_input
        )

    @property
    def layer_runs(self) -> tuple[LayerRun, ...]:
        """The runs `scan_layers` scans the layers in: one run of period 1 (one stack of
        every layer) when all are of one shape; else the prefix, repeated pattern and rest of
        the layers' shapes and kinds (sliding or full) that compile the fewest layer bodies.
        A `LayerRun` is `(start, period, repeats)`: position `j` of repeat `r` is layer
        `start + r * period + j`."""
        shapes = self.layer_shapes
        if len(set(shapes)) == 1:
            return (LayerRun(0, 1, self.num_hidden_layers),)
        return layer_runs(tuple(zip(shapes, self.sliding_layers, strict=True)))

    @property
    def layer_stacks(self) -> tuple[tuple[int, ...], ...]:
        """The layers each stack of a `scan_layers` model holds, in stack order, one stack per
        position of each run (`layer_runs`). The parameters are `layers/<name>` `[L, ...]`
        when there is one stack (every layer of one shape), else `layers/<s>/<name>`
        `[R_s, ...]` for stack `s`."""
        return tuple(run.members(j) for run in self.layer_runs for j in range(run.period))

    @property
    def layer_head_dims(self) -> tuple[int, ...]:
        """For each layer, its head width (`global_head_dim` for full-attention layers)."""
        wide = self.global_head_dim or self.head_dim
        return tuple(self.head_dim if s else wide for s in self.sliding_layers)

    @property
    def layer_kv_heads(self) -> tuple[int, ...]:
        """For each layer, its key/value heads (`num_global_key_value_heads` for
        full-attention layers)."""
        wide = self.num_global_key_value_heads or self.num_key_value_heads
        return tuple(self.num_key_value_heads if s else wide for s in self.sliding_layers)

    @property
    def kv_sources(self) -> tuple[int, ...]:
        """For each layer, the layer whose keys and values it attends over: itself, or for
        the last `num_kv_shared_layers` the last earlier layer of its own type."""
        first = self.num_hidden_layers - self.num_kv_shared_layers
        kinds = self.sliding_layers
        own = tuple(range(first))
        return own + tuple(
            max(j for j in own if kinds[j] == kinds[i]) for i in range(first, len(kinds))
        )

    @property
    def layer_shapes(self) -> tuple[tuple, ...]:
        """For each layer, what sets its weights' shapes: head width, key/value heads, whether
        it computes keys, values, its MLP width and kind, and whether it is a Gated DeltaNet
        layer."""
        sources = self.kv_sources
        wide = self.use_double_wide_mlp
        return tuple(
            (d, k, self.attention_k_eq_v and not s, sources[i] == i, wide and sources[i] != i, m, n)
            for i, (d, k, s, m, n) in enumerate(
                zip(
                    self.layer_head_dims,
                    self.layer_kv_heads,
                    self.sliding_layers,
                    self.moe_layers,
                    self.linear_layers,
                    strict=True,
                )
            )
        )

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """For each layer, whether it attends within `sliding_window` only."""
        if self.layer_types is None:
            return (self.sliding_window is not None,) * self.num_hidden_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    def _check_mrope(self) -> None:
        section = self.mrope_section
        if section is None:
            return
        if (
            not isinstance(section, tuple)
            or len(section) != 3
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in section)
        ):
            raise ValueError(
                f"mrope_section must be None or a tuple of 3 ints >= 0, got {section!r}."
            )
        if self.rope_scaling is not None:
            raise ValueError("mrope_section is supported with plain RoPE only (rope_scaling None).")

    def _check_experts(self) -> None:
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int):
            raise TypeError(f"num_experts must be an int, got {self.num_experts!r}.")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}.")
        check_positive_int(self.num_experts_per_tok, "num_experts_per_tok")
        check_positive_int(self.decoder_sparse_step, "decoder_sparse_step")
        if self.moe_intermediate_size is None:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        check_positive_int(self.moe_intermediate_size, "moe_intermediate_size")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts "
                f"({self.num_experts}): a token cannot be routed to more experts than exist."
            )
        layers = self.mlp_only_layers
        if isinstance(layers, str) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers
        ):
            raise TypeError(f"mlp_only_layers must be a sequence of ints, got {layers!r}.")
        layers = tuple(sorted(set(layers)))
        if any(not 0 <= i < self.num_hidden_layers for i in layers):
            raise ValueError(
                f"mlp_only_layers must be layer indices in [0, {self.num_hidden_layers}), got "
                f"{list(layers)}."
            )
        object.__setattr__(self, "mlp_only_layers", layers)

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """For each layer, whether it is a mixture of experts (see `decoder_sparse_step`)."""
        return tuple(
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_hidden_layers)
        )

    def __hash__(self) -> int:
        # The config is static module data that `jax.jit` hashes; `rope_scaling` is a dict.
        fields = dataclasses.astuple(self)
        index = [f.name for f in dataclasses.fields(self)].index("rope_scaling")
        scaling = self.rope_scaling and tuple(sorted(self.rope_scaling.items()))
        return hash((*fields[:index], scaling, *fields[index + 1 :]))
