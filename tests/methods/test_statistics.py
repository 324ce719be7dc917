"""Which tensors every method sends dense (fedcomp.methods.statistics): small ones and running
statistics, by the last component of their name."""

from __future__ import annotations

import pytest
import torch

from fedcomp.codecs import SBC, DenseFP32
from fedcomp.methods.statistics import is_statistic, sent_dense
from fedcomp.methods.update import UpdateEncoder


@pytest.mark.parametrize(
    "name",
    ["running_var", "bn1.running_mean", "layer1.0.bn2.running_var", "bn/moving_mean", "block/bn/moving_variance:0"],
)
def test_running_statistics_are_known_by_name(name: str) -> None:
    assert is_statistic(name) and sent_dense(name, 10**6, 1000)


@pytest.mark.parametrize(
    "name",
    ["bn1.weight", "bn1.num_batches_tracked", "running_var_scale", "my_running_var", "x.running_var.weight", "var"],
)
def test_other_names_are_not(name: str) -> None:
    assert not is_statistic(name)
    assert not sent_dense(name, 1000, 1000) and sent_dense(name, 999, 1000)


def test_the_uplink_encoder_sends_a_large_statistic_dense_with_no_residual() -> None:
    g = torch.Generator().manual_seed(0)
    update = {"conv.weight": torch.randn(5000, generator=g), "bn.running_var": torch.rand(4096, generator=g)}
    enc = UpdateEncoder(SBC(p=0.01), min_numel=1000, error_feedback=True)
    codecs = [t.codec_id for t in enc.encode(update, base_model_version=1).tensors]
    assert codecs == [SBC.codec_id, DenseFP32.codec_id]
    assert enc.feedback is not None and enc.feedback.residual("bn.running_var") is None
