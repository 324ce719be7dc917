"""The method registry: the built-in methods are found by id, a new method is one file plus one
registry line (``toy_method.py``), and the strategy and mod run it without naming it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fedcomp.codecs import DenseFP16
from fedcomp.errors import ConfigError
from fedcomp.flower.settings import CompressionConfig
from fedcomp.methods.base import UplinkMethod
from fedcomp.methods.registry import DOWNLINKS, UPLINKS, get_downlink, get_uplink, register_uplink
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
from tests.methods import toy_method

__all__ = ["server_identity"]  # the helpers' autouse fixture, active in this module


@pytest.fixture
def toy() -> Iterator[type[UplinkMethod]]:
    toy_method.register()
    yield toy_method.HalfUplink
    UPLINKS.pop(toy_method.HalfUplink.method_id)


def test_builtin_methods_are_registered_by_their_ids() -> None:
    assert set(UPLINKS) == {"sbc", "stc", "topk", "deft", "gradiveq", "dense-fp32", "dense-fp16", "identity"}
    assert set(DOWNLINKS) == {
        "3lc",
        "dense-fp32",
        "dense-fp16",
        "identity",
        "lattice",
        "sparse-fp32",
        "sparse-fp16",
        "auto",
    }
    for mid, cls in UPLINKS.items():
        assert cls.method_id == mid and get_uplink(mid) is cls
    with pytest.raises(ConfigError, match="uplink-codec: unknown uplink method 'nope'"):
        get_uplink("nope")
    with pytest.raises(ConfigError, match="downlink-codec: unknown downlink method 'nope'"):
        get_downlink("nope")


def test_an_id_is_registered_once() -> None:
    class Impostor(UplinkMethod):
        method_id = "sbc"

    with pytest.raises(ConfigError, match="already registered"):
        register_uplink(Impostor)
    assert UPLINKS["sbc"].__name__ == "SBCUplink"


def test_a_toy_method_runs_through_strategy_and_mod(toy: type[UplinkMethod]) -> None:
    # The config accepts the new id without any change to the settings model.
    assert CompressionConfig.from_run_config({"uplink-codec": "toy-half"}).uplink_codec == "toy-half"
    strategy = make_strategy(**{"uplink-codec": "toy-half", "downlink-codec": "dense-fp32"})
    model = tiny_model()
    clients = {n: Client(n) for n in (1, 2, 3)}
    for rnd in (1, 2):
        new, log = train_round(strategy, clients, rnd, model)
        assert new is not None
        decoded = {}
        for node, up in log.uplinks.items():
            update = update_from_bytes(up["payload"])  # type: ignore[arg-type]
            # Tensors at or above min-compress-numel use the method's codec, the rest go dense.
            assert {t.name: t.codec_id for t in update.tensors} == {
                "w1": "dense-fp16",
                "w2": "dense-fp16",
                "b": "dense-fp32",
            }
            decoded[node] = decode_payload(up["payload"], model, DenseFP16())  # type: ignore[arg-type]
            # fp16 is lossy, so what was sent differs from the local delta by the carried residual.
            assert 0 < max_abs_diff(decoded[node], local_delta(node, rnd, model)) < 1e-4
        # The server applied each decoded update to W with FedAvg's weights.
        mean = weighted_mean(decoded)
        assert max_abs_diff(new, {k: model[k] + mean[k] for k in model}) < 1e-6
        # The method's own server-side hook reports through the strategy.
        assert strategy.round_metrics(rnd) == {"toy_decoded": 3}
        model = new
