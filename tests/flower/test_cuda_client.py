"""A client whose model lives on a GPU (``client-device = 'cuda'``): the same uplink bytes, the
same aggregated models and the same stored state as a CPU client, round after round, through the
real mod and strategy (the whole-update engines of ``fedcomp.methods.flat_update`` and the
one-copy record helpers run there). Skipped without CUDA; on CPU the engines are compared with
the per-tensor path by tests/methods/test_flat_update.py."""

from __future__ import annotations

import pytest
import torch

from fedcomp.flower import protocol
from fedcomp.flower.records import digest, tensors_from_record
from tests.flower.helpers import Client, make_strategy, payloads_of, server_identity, tiny_model, train_round

__all__ = ["server_identity"]  # the autouse fixture, imported so it applies here (Flower asks for a run id)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.mark.parametrize("error_feedback", [True, False])
def test_a_cuda_client_sends_and_keeps_what_a_cpu_client_does(error_feedback: bool) -> None:
    runs = {}
    for device in ("cpu", "cuda"):
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
                    {n: payloads_of(u) for n, u in sorted(log.uplinks.items())},
                    {
                        n: digest(tensors_from_record(c.ctx.state.array_records[protocol.STATE_RESIDUAL]))
                        for n, c in clients.items()
                    },
                )
            )
        runs[device] = seen
    assert runs["cuda"] == runs["cpu"]


def test_records_and_digests_of_cuda_tensors_equal_the_cpu_ones() -> None:
    from fedcomp.flower.records import record_from_tensors

    model = tiny_model(3)
    on_gpu = {k: v.cuda() for k, v in model.items()}
    assert digest(on_gpu) == digest(model)
    back = tensors_from_record(record_from_tensors(on_gpu), "cuda")
    assert list(back) == list(model)
    assert all(back[k].device.type == "cuda" and torch.equal(back[k].cpu(), model[k]) for k in model)
