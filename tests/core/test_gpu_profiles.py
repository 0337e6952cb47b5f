"""The architecture profiles decide the runtime's kernel features (one source of truth)."""

import pytest

from trtc.gpu_profiles import (
    DEFAULT_SM_COUNT,
    FEATURES,
    arch_name,
    architecture_profiles,
    features_of,
    has_feature,
    sm_count,
)


def test_features_follow_the_profiles():
    assert features_of((9, 0)) == {"mma_fragments", "fp8_matmul", "pdl", "bulk_prefetch"}
    assert features_of((8, 9)) == {"mma_fragments", "fp8_matmul"}  # FP8 from sm89 only
    assert features_of((8, 0)) == {"mma_fragments"}
    # A GPU between profiles gets the highest profile not above it; below them all, nothing.
    assert features_of((8, 7)) == features_of((8, 6))
    assert features_of((7, 5)) == frozenset()
    assert arch_name((9, 0)) == "sm90" and arch_name((8, 6)) == "sm86"
    for name, profile in architecture_profiles().items():
        assert set(profile["features"]) <= set(FEATURES), name


def test_unknown_feature_is_refused_and_cpu_has_none():
    import torch

    with pytest.raises(ValueError, match="not a kernel feature"):
        has_feature(torch.device("cpu"), "tma")
    assert not has_feature(torch.device("cpu"), "pdl")


def test_sm_count_is_the_gpus_and_a_default_off_it():
    import torch

    assert sm_count(torch.device("cpu")) == DEFAULT_SM_COUNT
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        assert sm_count(torch.device("cuda", 0)) == props.multi_processor_count
