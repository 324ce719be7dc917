"""The STC uplink through the real strategy and mod, in process: clients send ternary tensors
(both signs, one magnitude per tensor) and the server applies them to W."""

from __future__ import annotations

import torch

from fedcomp.codecs import STC
from fedcomp.flower.settings import CompressionConfig
from fedcomp.methods.registry import get_uplink
from fedcomp.methods.stc import STCUplink
from fedcomp.wire.serde import update_from_bytes
from tests.flower.helpers import (
    Client,
    decode_payload,
    local_delta,
    make_strategy,
    max_abs_diff,
    server_identity,
    tiny_model,
    train_round,
    weighted_mean,
)

__all__ = ["server_identity"]  # the helpers' autouse fixture, active in this module


def test_stc_is_registered_and_reuses_the_sbc_p_schedule() -> None:
    assert get_uplink("stc") is STCUplink
    config = CompressionConfig.from_run_config({"uplink-codec": "stc", "sbc-p": 0.05})
    assert STCUplink.codec_config(config, 1) == {"id": "stc", "p": 0.05}
    assert STCUplink.adapts_p and STCUplink.error_feedback
    assert STCUplink.with_p({"id": "stc", "p": 0.05}, 0.02) == {"id": "stc", "p": 0.02}
    assert STCUplink.p_of(STCUplink.with_p({"id": "stc", "p": 0.05}, 3.0)) == 1.0


def test_stc_uplink_runs_through_strategy_and_mod() -> None:
    strategy = make_strategy(**{"uplink-codec": "stc", "downlink-codec": "dense-fp32", "sbc-p": 0.02})
    model = tiny_model()
    clients = {n: Client(n) for n in (1, 2, 3)}
    for rnd in (1, 2):
        new, log = train_round(strategy, clients, rnd, model)
        assert new is not None
        decoded = {}
        for node, up in log.uplinks.items():
            update = update_from_bytes(up["payload"])  # type: ignore[arg-type]
            # Tensors at or above min-compress-numel use STC, the small bias goes dense.
            assert {t.name: t.codec_id for t in update.tensors} == {"w1": "stc", "w2": "stc", "b": "dense-fp32"}
            decoded[node] = decode_payload(up["payload"], model, STC())  # type: ignore[arg-type]
            delta = local_delta(node, rnd, model)
            for name in ("w1", "w2"):
                d = decoded[node][name].reshape(-1)
                kept = d != 0
                k = round(0.02 * d.numel())
                assert int(kept.sum()) == k
                assert torch.unique(d[kept].abs()).numel() == 1  # one magnitude per tensor
                assert bool((d[kept] > 0).any()) and bool((d[kept] < 0).any())  # both signs
            assert max_abs_diff({"b": decoded[node]["b"]}, {"b": delta["b"]}) < 1e-6  # dense fp32
            if rnd == 1:  # no residual yet: the signs are the local delta's own
                for name in ("w1", "w2"):
                    d, x = decoded[node][name].reshape(-1), delta[name].reshape(-1)
                    assert torch.equal(torch.sign(d[d != 0]), torch.sign(x[d != 0]))
        # The server applied each decoded update to W with FedAvg's weights.
        mean = weighted_mean(decoded)
        assert max_abs_diff(new, {k: model[k] + mean[k] for k in model}) < 1e-6
        model = new
