"""`kit.rollout_batch`: GRPO's scored batch, on the devices and as a process's rows."""

import jax
import numpy as np

import tests.recipes._scripts  # noqa: F401 (puts recipes/ on the path)

from kit import parallel, rollout_batch
from kit.rollout_batch import RolloutBatch


def _batch(rng, *, routing: bool, pixels: bool) -> RolloutBatch:
    """Random host rows of 4 prompts' groups of 2, every field filled where asked."""
    template = rollout_batch.template(4, 2, 5, 3, routing=(2, 1) if routing else None)
    filled = {
        k: rng.integers(0, 7, v.shape).astype(v.dtype)
        for k, v in template.saved().items()
        if k not in ("version", "fingerprint")
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
    """B prompts of P ids, G completions of N tokens each, routing over P + N positions."""
    t = rollout_batch.template(3, 4, 5, 6, routing=(2, 8))
    assert t.prompt_tokens.shape == t.prompt_where.shape == (3, 5)
    assert t.tokens.shape == t.where.shape == t.logps.shape == (12, 6)
    assert t.scores.shape == t.right.shape == t.lengths.shape == (12,)
    assert t.routing.shape == (12, 11, 2, 8) and t.pixels is None
    assert (t.tokens.dtype, t.where.dtype, t.logps.dtype) == (np.int32, bool, np.float32)
