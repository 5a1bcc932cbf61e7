"""A reward model: a decoder whose last hidden state is read by a score vector.

    r(x, y) = w . h_last(x; y)        (pooling "last", the usual form)
    r(x, y) = mean_j w . h_j(x; y)    (pooling "mean", over the completion's tokens j)

where h_last is the decoder's final-norm hidden state at the last real token of a prompt x
and its completion y (after reading every token, EOS included), h_j the one at completion
token j (after reading it), and w the score head `[H]`
(a Hugging Face sequence classifier's `score.weight`, `[1, H]`, without bias: the
Bradley-Terry likelihood depends on reward differences only). `recipes/reward_model.py` trains
one; `recipes/grpo.py --reward-model` scores its rollouts with it. A reward model's folder is
a recipe model folder (`kit.models.save_model`) with the head in `score.safetensors` beside
the weights.
"""

from pathlib import Path
from typing import NamedTuple

from kit.errors import UserError

HEAD_FILE = "score.safetensors"


POOLINGS = ("last", "mean")


class RewardModel(NamedTuple):
    """A loaded reward model: the decoder (`kit.models.Model`), its score head `[H]` and how
    it pools the sequence (`POOLINGS`)."""

    model: object
    head: object
    pooling: str


def init_head(hidden_size: int, seed: int):
    """A score head `[H]` drawn from N(0, 1 / H), so that the first rewards are O(1)."""
    import jax

    key = jax.random.fold_in(jax.random.key(seed), 0x5C0E)
    return jax.random.normal(key, (hidden_size,)) / hidden_size**0.5


def scores(graphdef, params, head, tokens, where, completion, *, pooling: str = "last"):
    """`[B]` rewards of whole sequences `tokens [B, T]` (real where `where`, padded on either
    side; `completion` marks the completion's tokens): the head times the hidden state of each
    row's last real token (`pooling="last"`), or the mean of the head times the hidden states
    of its completion tokens (`"mean"`); 0 on a row without one."""
    import jax.numpy as jnp
    from flax import nnx

    model = nnx.merge(graphdef, params)
    per_token = model(tokens, where=where).astype(jnp.float32) @ head.astype(jnp.float32)
    if pooling == "mean":
        count = completion.sum(axis=1)
        total = jnp.where(completion, per_token, 0.0).sum(axis=1)
        return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)
    last = jnp.max(jnp.where(where, jnp.arange(tokens.shape[1]), -1), axis=1)
    at_last = jnp.take_along_axis(per_token, jnp.maximum(last, 0)[:, None], axis=1)[:, 0]
    return jnp.where(last >= 0, at_last, 0.0)


def whole_sequences(rows: dict):
    """A training batch's rows (`tokens`, `targets`, `attention_where`, left-aligned as
    `tunelib.data` lays them out) as whole sequences: the inputs with the final target (EOS)
    appended, so that the last position has read every token. Returns `(tokens, where,
    completion)`, one column wider; `completion` marks the completion's tokens as inputs."""
    import jax.numpy as jnp

    tokens, targets, where = rows["tokens"], rows["targets"], rows["attention_where"]
    length = where.sum(axis=1)  # the inputs are a prefix of each row
    final = jnp.take_along_axis(targets, jnp.maximum(length - 1, 0)[:, None], axis=1)
    columns = jnp.arange(tokens.shape[1] + 1)[None, :]
    full = jnp.where(columns == length[:, None], final, jnp.pad(tokens, ((0, 0), (0, 1))))
    completion = jnp.pad(rows["where"], ((0, 0), (1, 0)))  # input t + 1 is target t
    return full, (columns <= length[:, None]) & (length[:, None] > 0), completion


def pair_scores(graphdef, params, head, batch: dict, *, pooling: str = "last"):
    """`(chosen, rejected, real)` `[P]` rewards of a padded preference batch's sides, from
    one forward pass over both; `real` is False on rows of padding."""
    import jax
    import jax.numpy as jnp

    rows = jax.tree.map(lambda c, r: jnp.concatenate([c, r]), batch["chosen"], batch["rejected"])
    rewards = scores(graphdef, params, head, *whole_sequences(rows), pooling=pooling)
    chosen, rejected = jnp.split(rewards, 2)
    return chosen, rejected, batch["chosen"]["where"].any(axis=1)


def completion_scores(
    graphdef, params, head, prompt_tokens, prompt_where, tokens, where, *, pooling: str = "last"
):
    """`[B * G]` rewards of sampled completions `tokens [B * G, N]` (row b * G + g continues
    prompt b of `prompt_tokens [B, P]`), as `tunelib.rollout.sample` returns them."""
    import jax.numpy as jnp

    group = tokens.shape[0] // prompt_tokens.shape[0]
    sequences = jnp.concatenate([jnp.repeat(prompt_tokens, group, axis=0), tokens], axis=1)
    prompt_where = jnp.repeat(prompt_where, group, axis=0)
    real = jnp.concatenate([prompt_where, where], axis=1)
    completion = jnp.concatenate([jnp.zeros_like(prompt_where), where], axis=1)
    return scores(graphdef, params, head, sequences, real, completion, pooling=pooling)


def save(folder: Path, model, params, head, *, pooling: str) -> None:
    """The decoder as a model folder (`kit.models.save_model`) and the head beside it, its
    pooling in the file's metadata."""
    import numpy as np
    from safetensors.numpy import save_file

    from kit import models, parallel

    models.save_model(folder, model, params)
    if parallel.is_main():
        weight = np.asarray(head, np.float32)[None, :]
        save_file({"score.weight": weight}, str(folder / HEAD_FILE), {"pooling": pooling})


def check_folder(path: Path) -> Path:
    """The folder of the reward model saved in `path` (a run folder of
    `recipes/reward_model.py` or its `model/`), or a `UserError` saying what is missing."""
    path = Path(path)
    for folder in (path / "model", path):
        if (folder / HEAD_FILE).is_file():
            return folder
    what = "no such folder" if not path.exists() else f"no {HEAD_FILE} there"
    raise UserError(
        f"--reward-model {path}: {what}; give a run folder of recipes/reward_model.py (or its "
        "model/)"
    )


def load(path: Path) -> RewardModel:
    """The reward model saved in `path` (see `check_folder`)."""
    import jax.numpy as jnp
    from safetensors import SafetensorError, safe_open

    from kit import models

    folder = check_folder(path)
    model = models.load_model(folder)
    try:
        with safe_open(str(folder / HEAD_FILE), framework="numpy") as file:
            weight, pooling = file.get_tensor("score.weight"), file.metadata()["pooling"]
    except (SafetensorError, KeyError, TypeError, OSError) as error:
        raise UserError(f"--reward-model {folder / HEAD_FILE}: unreadable ({error})") from None
    if weight.shape != (1, model.config.hidden_size):
        raise UserError(
            f"--reward-model {folder / HEAD_FILE}: score.weight has shape {weight.shape}, the "
            f"model's hidden size needs (1, {model.config.hidden_size})"
        )
    if pooling not in POOLINGS:
        raise UserError(f"--reward-model {folder / HEAD_FILE}: unknown pooling {pooling!r}")
    return RewardModel(model, jnp.asarray(weight[0]), pooling)
