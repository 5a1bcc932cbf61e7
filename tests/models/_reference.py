"""An independent float64 NumPy forward pass of the decoder, written from the equations.

It reads the weights from the model's NNX state (either layer layout) but shares no code with
`tunelib.models`: RoPE rotates channel pairs as complex numbers, attention runs head by head
over the visible keys only, and the Llama 3 frequencies follow the case-by-case description
of Meta's Llama 3.1 release.
"""

import math

import numpy as np
from flax import nnx


def params_of(model) -> dict:
    """The model's parameters as a nested dict of float64 NumPy arrays."""
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def convert(tree):
        if isinstance(tree, dict):
            return {k: convert(x) for k, x in tree.items()}
        return np.asarray(tree, np.float64)

    return convert(pure)


def layer_params(params: dict, index: int, scanned: bool) -> dict:
    layers = params["layers"]
    if not scanned:
        return layers[index]

    def pick(tree):
        return {k: pick(x) for k, x in tree.items()} if isinstance(tree, dict) else tree[index]

    return pick(layers)


def ref_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Rotary frequencies, one per channel pair, with the scaling applied case by case."""
    out = []
    for i in range(head_dim // 2):
        freq = 1.0 / theta ** (2 * i / head_dim)
        if scaling is not None and scaling["rope_type"] == "linear":
            freq = freq / scaling["factor"]
        elif scaling is not None:
            factor = scaling["factor"]
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            old_context = scaling["original_max_position_embeddings"]
            wavelen = 2 * math.pi / freq
            if wavelen < old_context / high:
                pass  # high frequency: unchanged
            elif wavelen > old_context / low:
                freq = freq / factor  # low frequency: interpolated
            else:
                smooth = (old_context / wavelen - low) / (high - low)
                freq = (1 - smooth) * freq / factor + smooth * freq
        out.append(freq)
    return np.array(out)


def ref_default_positions(where: np.ndarray) -> np.ndarray:
    """For each position, the number of real tokens strictly before it."""
    positions = np.zeros(where.shape, np.int64)
    for b in range(where.shape[0]):
        seen = 0
        for t in range(where.shape[1]):
            positions[b, t] = seen
            seen += int(where[b, t])
    return positions


def ref_rms_norm(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * scale


def ref_rope(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """Rotate `x [T, D]`: channels (i, i + D/2) are the real and imaginary parts of one number."""
    half = x.shape[-1] // 2
    z = x[:, :half] + 1j * x[:, half:]
    z = z * np.exp(1j * positions[:, None] * freqs[None, :])
    return np.concatenate([z.real, z.imag], axis=-1)


def ref_attention(x, p, cfg, positions, where, freqs):
    """Self-attention of one row `x [T, H]`; rows with no visible key give 0."""
    n_heads, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    t_len = x.shape[0]

    def project(name, width):
        return dense(x, p[name]).reshape(t_len, width, d)

    q, k, v = project("q_proj", n_heads), project("k_proj", n_kv), project("v_proj", n_kv)
    heads = []
    for n in range(n_heads):
        kv = n // (n_heads // n_kv)
        qn, kn, vn = q[:, n], k[:, kv], v[:, kv]
        if cfg.use_qk_norm:
            qn = ref_rms_norm(qn, p["q_norm"]["scale"], cfg.rms_norm_eps)
            kn = ref_rms_norm(kn, p["k_norm"]["scale"], cfg.rms_norm_eps)
        qn, kn = ref_rope(qn, positions, freqs), ref_rope(kn, positions, freqs)
        out = np.zeros((t_len, d))
        for t in range(t_len):
            window = cfg.sliding_window or t + 1
            visible = [s for s in range(t + 1) if where[s] and t - s < window]
            if not visible:
                continue
            scores = np.array([qn[t] @ kn[s] for s in visible]) / math.sqrt(d)
            weights = np.exp(scores - scores.max())
            weights /= weights.sum()
            out[t] = weights @ vn[visible]
        heads.append(out)
    return dense(np.concatenate(heads, axis=-1), p["o_proj"])


def dense(x, p):
    """`x @ kernel`, plus the bias where the projection has one."""
    return x @ p["kernel"] + p["bias"] if "bias" in p else x @ p["kernel"]


def ref_mlp(x, p):
    gate = dense(x, p["gate_proj"])
    return dense(gate / (1 + np.exp(-gate)) * dense(x, p["up_proj"]), p["down_proj"])


def ref_decoder(params, cfg, tokens, where=None, positions=None):
    """Final-norm hidden states `[B, T, H]` and logits `[B, T, V]`, float64."""
    tokens = np.asarray(tokens)
    where = np.ones(tokens.shape, bool) if where is None else np.asarray(where)
    positions = ref_default_positions(where) if positions is None else np.asarray(positions)
    freqs = ref_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    eps = cfg.rms_norm_eps
    embedding = params["embed_tokens"]["embedding"]
    hidden = []
    for b in range(tokens.shape[0]):
        x = embedding[np.where(where[b], tokens[b], 0)]
        for index in range(cfg.num_hidden_layers):
            p = layer_params(params, index, cfg.scan_layers)
            normed = ref_rms_norm(x, p["input_layernorm"]["scale"], eps)
            x = x + ref_attention(normed, p["self_attn"], cfg, positions[b], where[b], freqs)
            x = x + ref_mlp(ref_rms_norm(x, p["post_attention_layernorm"]["scale"], eps), p["mlp"])
        hidden.append(ref_rms_norm(x, params["norm"]["scale"], eps))
    hidden = np.stack(hidden)
    unembedding = embedding.T if cfg.tie_word_embeddings else params["lm_head"]["kernel"]
    return hidden, hidden @ unembedding
