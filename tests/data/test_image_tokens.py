"""Image markers expanded into soft tokens (transformers' layouts: tests of the Gemma 4 and
Qwen-VL preprocessing)."""

import numpy as np

from tests._helpers import raises_naming
from tunelib.data import expand_image_tokens


def test_markers_become_their_soft_tokens_with_or_without_begin_and_end():
    ids, where = expand_image_tokens(
        [4, 9, 5, 9], [2, 0], image_token_id=9, boi_token_id=7, eoi_token_id=8, where=[0, 0, 1, 1]
    )
    assert ids.tolist() == [4, 7, 9, 9, 8, 5, 7, 8] and ids.dtype == np.int32
    assert where.tolist() == [False] * 5 + [True] * 3
    ids, _ = expand_image_tokens([9, 4, 9], [1, 3], image_token_id=9)
    assert ids.tolist() == [9, 4, 9, 9, 9]
    ids, where = expand_image_tokens([4, 5], [], image_token_id=9)
    assert ids.tolist() == [4, 5] and where is None


def test_the_markers_must_match_the_images():
    with raises_naming("2 image tokens", "3 entries"):
        expand_image_tokens([4, 9, 9], [1, 1, 1], image_token_id=9)
    with raises_naming("where", "[2]", "[1]"):
        expand_image_tokens([4, 9], [1], image_token_id=9, where=[True])
    with raises_naming("where", "0 and 1"):
        expand_image_tokens([4, 9], [1], image_token_id=9, where=[0, 2])
