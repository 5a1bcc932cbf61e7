"""`kit.rollout_batch`: GRPO's scored batch, on the devices and as a process's rows."""

import jax
import numpy as np

import tests.recipes._scripts  # noqa: F401 (puts recipes/ on the path)

from kit import parallel
from kit.rollout_batch import RolloutBatch


# The fields' shapes for B prompts of P ids, G completions of N tokens, routing (M, k).
def _shapes(b=4, g=2, p=5, n=3, routing=(2, 1)) -> dict:
    shapes = {
        "prompt_tokens": ((b, p), np.int32), "prompt_where": ((b, p), bool),
        "tokens": ((b * g, n), np.int32), "where": ((b * g, n), bool),
        "logps": ((b * g, n), np.float32), "scores": ((b * g,), np.float32),
        "right": ((b * g,), bool), "lengths": ((b * g,), np.int32),
    }  # fmt: skip
    if routing:
        shapes["routing"] = ((b * g, p + n, *routing), np.int32)
    return shapes


def _batch(rng, *, routing: bool, pixels: bool) -> RolloutBatch:
    """Random host rows of 4 prompts' groups of 2, every field filled where asked."""
    filled = {
        k: rng.integers(0, 7, shape).astype(dtype)
        for k, (shape, dtype) in _shapes(routing=(2, 1) if routing else None).items()
    }
    images = {"pixel_values": rng.normal(size=(4, 2, 3)).astype(np.float32)} if pixels else None
    return RolloutBatch(
        **filled, version=np.int32(3), fingerprint=np.uint32(2**31 + 5), pixels=images
    )


def test_rows_placed_on_the_devices_come_back_as_they_were():
    """`placed` splits each array's rows (4 prompts, 8 completions) over 4 devices, `local`
    gathers this process's rows back to NumPy; the stamp stays on the host, untouched."""
    placement = parallel.placement(4, 4)
    rows = _batch(np.random.default_rng(0), routing=True, pixels=True)
    placed = rows.placed(placement)
    assert placed.tokens.sharding.is_equivalent_to(placement.by_rows(), 2)
    assert len(placed.tokens.sharding.device_set) == 4
    assert placed.pixels["pixel_values"].sharding.is_equivalent_to(placement.by_rows(), 3)
    assert (placed.version, placed.fingerprint) == (3, 2**31 + 5)
    back = placed.local(placement)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(rows), strict=True):
        assert isinstance(got, np.ndarray | np.generic) and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_the_learner_reads_every_array_but_the_stamp_and_the_images_by_their_names():
    rows = _batch(np.random.default_rng(1), routing=False, pixels=True)
    arrays = rows.arrays()
    assert set(arrays) == {
        "prompt_tokens", "prompt_where", "tokens", "where", "logps", "scores", "right",
        "lengths", "pixel_values",
    }  # fmt: skip
    assert arrays["pixel_values"] is rows.pixels["pixel_values"]


def test_what_a_checkpoint_keeps_makes_the_batch_again():
    """`saved` leaves out the absent fields (a checkpoint holds no None); the batch it
    rebuilds is the same, with or without the recorded routing."""
    for routing in (False, True):
        rows = _batch(np.random.default_rng(2), routing=routing, pixels=False)
        saved = rows.saved()
        assert ("routing" in saved) == routing and "pixels" not in saved
        again = RolloutBatch(**saved)
        assert jax.tree.structure(again) == jax.tree.structure(rows)
        for got, want in zip(jax.tree.leaves(again), jax.tree.leaves(rows), strict=True):
            np.testing.assert_array_equal(got, want)


def test_the_template_has_the_shapes_the_sampler_makes():
    """`Sampler.template` (zeros, from `jax.eval_shape` of the sampler's call) against the
    rows of a batch the sampler makes: the same fields, shapes and dtypes."""
    from tunelib.data import CharTokenizer

    from kit import grpo, models
    from kit.grpo_config import GRPOConfig

    config = GRPOConfig(batch_size=4, group_size=2, num_prompts=16, num_heldout=4, max_new_tokens=5)
    placement = parallel.placement(config.batch_size, 1)
    model = models.new_model(CharTokenizer(), "student", seed=0)
    _, tuning, _, _, sample, _ = grpo.setup(config, model, placement)
    policy = tuning.policy(tuning.trainable)
    made = sample(policy, np.arange(4), jax.random.key(0), version=0).local(placement)
    template = sample.template(policy, 4)
    assert template.tokens.shape == (8, 5) and not template.tokens.any()
    for name, want in made.saved().items():
        got = getattr(template, name)
        assert (np.shape(got), np.asarray(got).dtype) == (np.shape(want), np.asarray(want).dtype)
    assert set(template.saved()) == set(made.saved())
