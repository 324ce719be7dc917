"""LeNet5Caffe, local training and evaluation (fedcomp.app.models)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from fedcomp.app.data import load_dataset
from fedcomp.app.models import LeNet5Caffe, evaluate, state_dict_nbytes, train_local


def test_lenet_shapes_and_size() -> None:
    model = LeNet5Caffe()
    assert model(torch.zeros(7, 1, 28, 28)).shape == (7, 10)
    assert sum(p.numel() for p in model.parameters()) == 431_080  # as in the SBC paper
    assert state_dict_nbytes(model) == 431_080 * 4
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {
        "conv1.weight": (20, 1, 5, 5), "conv1.bias": (20,),
        "conv2.weight": (50, 20, 5, 5), "conv2.bias": (50,),
        "fc1.weight": (500, 800), "fc1.bias": (500,),
        "fc2.weight": (10, 500), "fc2.bias": (10,),
    }  # fmt: skip


def test_a_few_steps_reduce_loss_on_digits() -> None:
    torch.manual_seed(0)
    ds = load_dataset("digits")
    model = LeNet5Caffe()
    loss0, acc0 = evaluate(model, ds.test.x, ds.test.y)
    gen = torch.Generator().manual_seed(0)
    train_loss = train_local(model, (ds.train.x, ds.train.y), 30, 1e-3, "adam", generator=gen)
    loss1, acc1 = evaluate(model, ds.test.x, ds.test.y)
    assert loss1 < 0.5 * loss0 and acc1 > acc0 + 0.3, (loss0, acc0, loss1, acc1)
    assert 0 < train_loss < loss0


def test_iterations_are_exact_and_data_cycles() -> None:
    x, y = torch.randn(10, 1, 28, 28), torch.randint(0, 10, (10,))
    steps = []
    model = LeNet5Caffe()
    model.register_forward_hook(lambda *_: steps.append(1))
    # 10 samples, batch 4 -> 2 batches per epoch; 7 iterations cycle through 4 epochs.
    train_local(model, (x, y), 7, 1e-3, "sgd", batch_size=4)
    assert len(steps) == 7
    steps.clear()
    loader = DataLoader(TensorDataset(x, y), batch_size=4)  # 3 batches per pass
    train_local(model, loader, 8, 1e-3, "sgd")
    assert len(steps) == 8


def test_training_is_deterministic_given_seeds() -> None:
    ds = load_dataset("digits")
    out = []
    for _ in range(2):
        torch.manual_seed(1)
        model = LeNet5Caffe()
        gen = torch.Generator().manual_seed(5)
        train_local(model, (ds.train.x, ds.train.y), 3, 1e-3, generator=gen)
        out.append(model.fc2.weight.detach().clone())
    assert torch.equal(out[0], out[1])


def test_evaluate_accuracy() -> None:
    class Fixed(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.one_hot(torch.zeros(len(x), dtype=torch.long), 10).float()

    y = torch.tensor([0, 0, 1, 2])
    loss, acc = evaluate(Fixed(), torch.zeros(4, 1, 28, 28), y, batch_size=3)
    assert acc == 0.5 and loss > 0
