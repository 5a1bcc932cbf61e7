import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close
from tests.models._reference import ref_frequencies
from tunelib.models import DecoderConfig, rope_frequencies

LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    ("head_dim", "theta", "scaling"),
    [
        (128, 500000.0, LLAMA31),  # Llama 3.1 8B
        (64, 500000, {**LLAMA31, "factor": 32.0}),  # Llama 3.2 1B
        (16, 10000.0, {**LLAMA31, "original_max_position_embeddings": 64}),
        (128, 10000.0, None),
        (8, 1000000, {"rope_type": "linear", "factor": 4}),
    ],
)
def test_matches_reference(head_dim, theta, scaling):
    assert_close(
        rope_frequencies(head_dim, theta=theta, scaling=scaling),
        ref_frequencies(head_dim, theta, scaling),
        rtol=1e-13,
        atol=0,
    )


def test_llama31_regions():
    omega = rope_frequencies(128, theta=500000.0)
    scaled = rope_frequencies(128, theta=500000.0, scaling=LLAMA31)
    wavelength = 2 * np.pi / omega
    high = wavelength < 8192 / 4
    low = wavelength > 8192 / 1
    middle = ~high & ~low
    assert high.any() and low.any() and middle.any()
    np.testing.assert_array_equal(scaled[high], omega[high])
    assert_close(scaled[low], omega[low] / 8, rtol=1e-15, atol=0)
    assert np.all(scaled[middle] > omega[middle] / 8) and np.all(scaled[middle] < omega[middle])


@given(
    st.sampled_from([4, 8, 16, 64, 128]),
    st.floats(100.0, 1e6),
    st.floats(1.0, 64.0),
    st.floats(0.5, 4.0),
    st.floats(1.1, 8.0),
    st.integers(16, 10000),
)
def test_llama3_properties(head_dim, theta, factor, low, ratio, context):
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": low * ratio,
        "original_max_position_embeddings": context,
    }
    DecoderConfig(
        vocab_size=2,
        hidden_size=head_dim,
        intermediate_size=2,
        num_hidden_layers=1,
        num_attention_heads=1,
        rope_scaling=scaling,
    )  # a valid config
    omega = rope_frequencies(head_dim, theta=theta)
    scaled = rope_frequencies(head_dim, theta=theta, scaling=scaling)
    assert_close(scaled, ref_frequencies(head_dim, theta, scaling), rtol=1e-12, atol=0)
    # Each frequency lies between its interpolated and its original value ...
    assert np.all(scaled <= omega * (1 + 1e-12)) and np.all(scaled >= omega / factor * (1 - 1e-12))
    # ... and they still decrease along the head, so no two pairs swap roles.
    assert np.all(np.diff(scaled) <= 0)
