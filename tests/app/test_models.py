"""The reference app's models, and its training and evaluation on the CPU: subnormal floats
flushed to zero inside them only (``fedcomp.app.models.flushing_denormals``)."""

from __future__ import annotations

from typing import get_args

import pytest
import torch
from flwr.app import Context, RecordDict

from fedcomp.app.apps import client_initial_model
from fedcomp.app.config import Dataset
from fedcomp.app.data import DATASETS
from fedcomp.app.models import MODELS, CharLSTM, LeNet5Caffe, evaluate, flushing_denormals, model_for, train_local
from fedcomp.errors import ConfigError

TINY = 1e-39  # a float32 subnormal


def _kept(value: float = TINY) -> bool:
    """Whether this thread's float32 arithmetic keeps a subnormal result."""
    return float(torch.tensor([value]) * 1.0) != 0.0


def test_subnormals_are_flushed_inside_and_kept_after() -> None:
    assert _kept()
    with flushing_denormals():
        if _kept():
            pytest.skip("this CPU cannot flush subnormals (torch.set_flush_denormal returned False)")
    assert _kept()  # back to torch's default: the codecs must read subnormal values exactly
    with pytest.raises(RuntimeError), flushing_denormals():
        raise RuntimeError("training failed")
    assert _kept()


def test_training_and_evaluation_leave_subnormals_as_they_were() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
    model = LeNet5Caffe()
    train_local(model, (x, y), 2, lr=0.01, generator=g)
    assert _kept()
    evaluate(model, x, y)
    assert _kept()


def test_every_dataset_has_its_model_and_another_name_is_a_config_error() -> None:
    assert set(MODELS) == set(get_args(Dataset)) == set(DATASETS)
    assert isinstance(model_for("shakespeare"), CharLSTM) and isinstance(model_for("mnist"), LeNet5Caffe)
    for bad in ("cifar10", 5):
        ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={"dataset": bad})
        with pytest.raises(ConfigError, match=r"^dataset: must be"):
            client_initial_model(ctx)
