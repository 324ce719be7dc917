"""A client whose model lives on a GPU (``client-device = 'cuda'``): the same uplink bytes, the
same aggregated models and the same stored state as a CPU client, round after round, through the
real mod and strategy (the whole-update engines of ``fedcomp.methods.flat_update`` and the
one-copy record helpers run there). Skipped without CUDA; on CPU the engines are compared with
the per-tensor path by tests/methods/test_flat_update.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fedcomp.flower import protocol
from fedcomp.flower.records import digest, tensors_from_record
from tests.flower.helpers import Client, make_strategy, server_identity, tiny_model, train_round

__all__ = ["server_identity"]  # the autouse fixture, imported so it applies here (Flower asks for a run id)

_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def cuda(test: Callable[..., None]) -> Callable[..., None]:
    """Marked ``cuda`` (``pytest -m cuda``) and skipped without a CUDA device."""
    return pytest.mark.cuda(_no_cuda(test))


def _run(device: str, error_feedback: bool) -> list[tuple]:
    """Four rounds of three clients on ``device``: per round the model's digest, each client's
    uplink payload and the digest of each client's stored residual."""
    strategy = make_strategy(**{"client-device": device, "error-feedback": error_feedback})
    clients = {n: Client(n) for n in (1, 2, 3)}
    model = tiny_model()
    seen = []
    for rnd in range(1, 5):
        new, log = train_round(strategy, clients, rnd, model)
        assert new is not None
        model = new
        seen.append(
            (
                digest(model),
                {n: bytes(u["payload"]) for n, u in sorted(log.uplinks.items())},
                {
                    n: digest(tensors_from_record(c.ctx.state.array_records[protocol.STATE_RESIDUAL]))
                    for n, c in clients.items()
                },
            )
        )
    return seen


@cuda
@pytest.mark.parametrize("error_feedback", [True, False])
def test_a_cuda_client_sends_and_keeps_what_a_cpu_client_does(error_feedback: bool) -> None:
    assert _run("cuda", error_feedback) == _run("cpu", error_feedback)


def test_the_cpu_run_that_the_cuda_client_is_compared_with_repeats_itself() -> None:
    # (runs everywhere: the comparison above is only as good as this run; the first GPU run found
    # this file's body broken, which no CPU test had run)
    first = _run("cpu", True)
    assert first == _run("cpu", True)
    assert len({rnd[0] for rnd in first}) == 4 and all(len(rnd[1]) == 3 for rnd in first)


@cuda
def test_records_and_digests_of_cuda_tensors_equal_the_cpu_ones() -> None:
    from fedcomp.flower.records import record_from_tensors

    model = tiny_model(3)
    on_gpu = {k: v.cuda() for k, v in model.items()}
    assert digest(on_gpu) == digest(model)
    back = tensors_from_record(record_from_tensors(on_gpu), "cuda")
    assert list(back) == list(model)
    assert all(back[k].device.type == "cuda" and torch.equal(back[k].cpu(), model[k]) for k in model)
