"""The method layer's small pieces, one by one (found by mutation testing,
``scripts/mutation.sh flower``): the base class defaults, the plain uplinks' codec configs and
``p`` handling, the downlinks, the registry's checks, and CompressionConfig's validation messages,
schedules, summary line and bandwidth budget."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord
from pydantic import ValidationError

from fedcomp.codecs import SBC, DenseFP32, ThreeLC, get_codec
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.flower import protocol
from fedcomp.flower.records import record_from_tensors
from fedcomp.methods import registry
from fedcomp.methods.base import ClientRound, DownlinkMethod, UplinkMethod, extra_key
from fedcomp.methods.config import CompressionConfig, format_validation_error
from fedcomp.methods.deft_uplink import DeftUplink
from fedcomp.methods.downlinks import DenseFP16Downlink, DenseFP32Downlink, IdentityDownlink, ThreeLCDownlink
from fedcomp.methods.gradiveq_uplink import GradiVeQUplink
from fedcomp.methods.plain import DenseFP16Uplink, DenseFP32Uplink, IdentityUplink, SBCUplink, TopKUplink
from fedcomp.methods.update import UpdateEncoder, specs_of
from tests.flower.helpers import (  # noqa: F401 (server_identity: autouse fixture)
    Client,
    FixedGrid,
    make_strategy,
    server_identity,
    tiny_model,
)


def _config(**run_config: Any) -> CompressionConfig:
    return CompressionConfig.from_run_config(run_config)


# --- base ----------------------------------------------------------------------------------------


class _Store:
    def __init__(self) -> None:
        self.values: dict[str, Any] | None = {"k": 1}

    def load(self) -> dict[str, Any] | None:
        return self.values

    def save(self, values: Any) -> None:
        self.values = dict(values)

    def clear(self) -> None:
        self.values = None


class _Bare(UplinkMethod):
    method_id = "bare"

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        return {"id": "sbc", "p": 0.1 * server_round, "mode": "fast"}


def test_extra_key() -> None:
    assert extra_key("deft", "allocation") == "deft.allocation"


def test_uplink_base_defaults() -> None:
    config = _config()
    m = _Bare(config)
    assert m.config is config and m.weighted_mean is True
    assert _Bare(config, weighted_mean=False).weighted_mean is False
    assert (UplinkMethod.error_feedback, UplinkMethod.adapts_p, UplinkMethod.reports_selection) == (True, False, False)
    assert m.round_codec_config(3) == {"id": "sbc", "p": pytest.approx(0.3), "mode": "fast"}
    assert m.downlink_extras(1, [1, 2], []) == {}
    assert m.note_node(1, None) is None
    assert m.finish(1, {}, {}) is None
    assert m.round_metrics(1) == {}
    assert _Bare.summary(config) == "bare {'id': 'sbc', 'p': 0.1, 'mode': 'fast'}"
    store = _Store()
    assert _Bare.client_status(store) == {}
    _Bare.client_forget(store)
    assert store.values is None
    with pytest.raises(NotImplementedError):
        UplinkMethod.codec_config(config, 1)
    with pytest.raises(NotImplementedError, match=r"^bare does not adapt p$"):
        _Bare.with_p({"id": "sbc"}, 0.1)
    with pytest.raises(NotImplementedError, match=r"^bare does not adapt p$"):
        _Bare.p_of({"id": "sbc"})


def test_uplink_base_client_codecs_and_receive() -> None:
    rnd = ClientRound(
        codec_config={"id": "sbc", "p": 0.2, "mode": "fast"},
        replica={},
        min_numel=1000,
        server_round=1,
        extras={},
        state=_Store(),
    )
    assert _Bare.client_receive(rnd) is None
    codec, overrides = _Bare.client_codecs(rnd)
    assert overrides is None
    assert isinstance(codec, SBC) and codec == get_codec(rnd.codec_config) and codec.p == 0.2


def test_uplink_base_decode_adds_the_delta_to_the_global_model() -> None:
    model = {"w": torch.arange(2000, dtype=torch.float32) / 2000, "b": torch.ones(3)}
    delta = {"w": torch.zeros(2000), "b": torch.tensor([0.5, -0.5, 0.25])}
    delta["w"][7] = 3.0
    m = _Bare(_config())
    # round 5: p = 0.5 (the codec must be the round's: p = 0.1 would drop nothing here either)
    update = UpdateEncoder(get_codec(m.round_codec_config(5)), min_numel=1000, error_feedback=False).encode(
        delta, base_model_version=0
    )
    out = m.decode(update, specs_of(model), model, 5, node=1)
    assert out.delta is not None
    assert torch.equal(out.delta["b"], delta["b"])  # small: dense fp32, exact
    for k in model:
        assert torch.equal(out.arrays[k], model[k] + out.delta[k])
    assert float(out.delta["w"][7]) > 0


def test_downlink_base() -> None:
    class D(DownlinkMethod):
        method_id = "d"

        @classmethod
        def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
            return {"id": "dense-fp32"}

    assert D.summary(_config()) == "d {'id': 'dense-fp32'}"
    with pytest.raises(NotImplementedError):
        DownlinkMethod.codec_config(_config(), 1)


# --- plain uplinks and the downlinks ---------------------------------------------------------------


def test_sbc_codec_config_follows_the_schedule_and_mode() -> None:
    config = _config(**{"sbc-p": "list:0.1,0.2", "sbc-mode": "exact"})
    assert SBCUplink.codec_config(config, 1) == {"id": "sbc", "p": 0.1, "mode": "exact"}
    assert SBCUplink.codec_config(config, 2) == {"id": "sbc", "p": 0.2, "mode": "exact"}
    assert SBCUplink.adapts_p and not SBCUplink.reports_selection


@pytest.mark.parametrize(("p", "expected"), [(0.05, 0.05), (0.5, 0.5), (0.7, 0.5), (0.0, 1e-12), (-1.0, 1e-12)])
def test_sbc_with_p_clamps_and_keeps_the_rest(p: float, expected: float) -> None:
    out = SBCUplink.with_p({"id": "sbc", "p": 0.01, "mode": "exact"}, p)
    assert out == {"id": "sbc", "p": expected, "mode": "exact"}
    assert type(out["p"]) is float
    assert SBCUplink.p_of(out) == expected


def test_sbc_p_of_is_a_float() -> None:
    got = SBCUplink.p_of({"id": "sbc", "p": 1})
    assert got == 1.0 and type(got) is float


def test_topk_and_fixed_uplinks() -> None:
    config = _config(**{"topk-density": "list:0.05,0.1"})
    assert TopKUplink.codec_config(config, 2) == {"id": "topk", "p": 0.1}
    assert TopKUplink.reports_selection and not TopKUplink.adapts_p
    for m, mid in ((DenseFP32Uplink, "dense-fp32"), (DenseFP16Uplink, "dense-fp16"), (IdentityUplink, "identity")):
        assert m.method_id == mid and m.codec_config(config, 3) == {"id": mid}


def test_downlinks() -> None:
    config = _config(**{"3lc-s": "list:1.0,1.5", "3lc-zero-run": False})
    assert ThreeLCDownlink.codec_config(config, 1) == {"id": "3lc", "s": 1.0, "zero_run": False}
    assert ThreeLCDownlink.codec_config(config, 2) == {"id": "3lc", "s": 1.5, "zero_run": False}
    for m, mid in (
        (DenseFP32Downlink, "dense-fp32"),
        (DenseFP16Downlink, "dense-fp16"),
        (IdentityDownlink, "identity"),
    ):
        assert m.method_id == mid and m.codec_config(config, 1) == {"id": mid}


# --- registry --------------------------------------------------------------------------------------------


def test_unknown_methods_name_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        registry.get_uplink("zip")
    assert str(info.value) == f"uplink-codec: unknown uplink method 'zip'; known: {sorted(registry.UPLINKS)}"
    with pytest.raises(ConfigError) as info:
        registry.get_downlink("zip")
    assert str(info.value) == f"downlink-codec: unknown downlink method 'zip'; known: {sorted(registry.DOWNLINKS)}"
    assert registry.get_uplink("sbc") is SBCUplink and registry.get_downlink("3lc") is ThreeLCDownlink


@pytest.mark.parametrize("mid", [None, "", 3])
def test_a_method_needs_a_string_id(monkeypatch: pytest.MonkeyPatch, mid: Any) -> None:
    monkeypatch.setattr(registry, "UPLINKS", dict(registry.UPLINKS))
    monkeypatch.setattr(registry, "DOWNLINKS", dict(registry.DOWNLINKS))
    attrs = {} if mid is None else {"method_id": mid}
    up = type("NoIdUp", (SBCUplink,), {})
    down = type("NoIdDown", (DownlinkMethod,), attrs)
    if mid is None:
        up.method_id = None  # type: ignore[assignment]
    else:
        up.method_id = mid
    before = (dict(registry.UPLINKS), dict(registry.DOWNLINKS))
    with pytest.raises(ConfigError) as info:
        registry.register_uplink(up)
    assert str(info.value) == "NoIdUp: a method needs a non-empty string method_id"
    with pytest.raises(ConfigError) as info:
        registry.register_downlink(down)
    assert str(info.value) == "NoIdDown: a method needs a non-empty string method_id"
    assert before == (registry.UPLINKS, registry.DOWNLINKS)


def test_register_adds_once_and_returns_the_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "UPLINKS", dict(registry.UPLINKS))
    monkeypatch.setattr(registry, "DOWNLINKS", dict(registry.DOWNLINKS))

    class Up(SBCUplink):
        method_id = "unit-up"

    class Down(ThreeLCDownlink):
        method_id = "unit-down"

    assert registry.register_uplink(Up) is Up and registry.get_uplink("unit-up") is Up
    assert registry.register_downlink(Down) is Down and registry.get_downlink("unit-down") is Down
    assert registry.register_uplink(Up) is Up  # the same class again: fine
    assert registry.register_downlink(Down) is Down

    class Other(SBCUplink):
        method_id = "unit-up"

    with pytest.raises(ConfigError) as info:
        registry.register_uplink(Other)
    assert str(info.value) == "method id 'unit-up' is already registered by Up"
    assert registry.get_uplink("unit-up") is Up

    class OtherDown(ThreeLCDownlink):
        method_id = "unit-down"

    with pytest.raises(ConfigError) as info:
        registry.register_downlink(OtherDown)
    assert str(info.value) == "method id 'unit-down' is already registered by Down"


# --- CompressionConfig -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        (
            {"sbc-p": 0.6, "min-compress-numel": -1},
            "sbc-p: value 0.6 is outside (0.0, 0.5] (got 0.6); "
            "min-compress-numel: Input should be greater than or equal to 0 (got -1)",
        ),
        ({"sbc-p-min": 0.2, "sbc-p-max": 0.1}, "sbc-p-max: must be >= sbc-p-min (0.2) (got 0.1)"),
        ({"local-iters-min": 5, "local-iters-max": 2}, "local-iters-max: must be >= local-iters-min (5) (got 2)"),
        (
            {"bandwidth-policy": "zzz"},
            "bandwidth-policy: unknown policy (known: ['constant-total-sparsity']) (got 'zzz')",
        ),
        (
            {"downlink-codec": "zip"},
            f"downlink-codec: unknown downlink method (known: {sorted(registry.DOWNLINKS)}) (got 'zip')",
        ),
        (
            {"uplink-codec": "zip"},
            f"uplink-codec: unknown uplink method (known: {sorted(registry.UPLINKS)}) (got 'zip')",
        ),
        (
            {"link-profiles": "garbage"},
            "link-profiles: profile 0 'garbage': expected 'UP,DOWN[,LATENCY]' (Mbit/s, Mbit/s, ms) (got 'garbage')",
        ),
        ({"local-iters": "list:2,2.5"}, "local-iters: local iterations must be whole numbers >= 1 (got 'list:2,2.5')"),
        ({"local-iters": 0}, "local-iters: local iterations must be whole numbers >= 1 (got 0)"),
        ({"3lc-s": 2.0}, "3lc-s: value 2.0 is outside [1.0, 2.0) (got 2.0)"),
        ({"topk-density": 0}, "topk-density: value 0.0 is outside (0.0, 0.5] (got 0)"),
    ],
)
def test_invalid_configs_name_every_bad_key(run_config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config(**run_config)
    assert str(info.value) == f"invalid configuration: {message}"


def test_equal_bounds_are_valid() -> None:
    c = _config(**{"sbc-p-min": 0.1, "sbc-p-max": 0.1, "local-iters-min": 3, "local-iters-max": 3})
    assert (c.sbc_p_min, c.sbc_p_max, c.local_iters_min, c.local_iters_max) == (0.1, 0.1, 3, 3)
    c = _config(**{"local-iters": 1, "link-profiles": "10,20,5"})
    assert c.local_iters_at(7) == 1 and c.link_profiles == "10,20,5"


def test_a_whole_model_error_is_named_config() -> None:
    with pytest.raises(ValidationError) as info:
        CompressionConfig.model_validate("x")
    assert format_validation_error(info.value) == (
        "invalid configuration: <config>: Input should be a valid dictionary or instance of CompressionConfig (got 'x')"
    )


def test_run_config_round_trip_and_schedules_out() -> None:
    c = _config(**{"sbc-p": "list:0.1,0.2", "local-iters": 5, "3lc-s": 1.5, "lr": 0.1})
    out = c.to_run_config()
    assert out["sbc-p"] == "list:0.1,0.2"
    assert out["local-iters"] == 5 and type(out["local-iters"]) is int
    assert out["3lc-s"] == 1.5 and type(out["3lc-s"]) is float
    assert out["topk-density"] == 0.01
    assert "lr" not in out
    assert set(out) == CompressionConfig.keys()
    assert CompressionConfig.from_run_config(out) == c
    assert {"sbc-p", "uplink-codec", "local-iters", "error-feedback"} <= CompressionConfig.keys()
    assert "sbc_p" not in set(CompressionConfig.keys())


def test_rounds_pick_schedule_values() -> None:
    c = _config(**{"local-iters": "list:3,5", "sbc-p": "list:0.1,0.2", "3lc-s": "list:1.0,1.5"})
    assert (c.local_iters_at(1), c.local_iters_at(2)) == (3, 5)
    assert type(c.local_iters_at(1)) is int
    assert c.uplink_codec_at(2) == get_codec({"id": "sbc", "p": 0.2, "mode": "fast"})
    down = c.downlink_codec_at(2)
    assert isinstance(down, ThreeLC) and down == get_codec({"id": "3lc", "s": 1.5, "zero_run": True})
    assert isinstance(_config(**{"downlink-codec": "dense-fp32"}).downlink_codec_at(1), DenseFP32)


def test_describe_is_one_line_with_the_settings() -> None:
    c = _config(**{"sbc-p": "list:0.1,0.2", "local-iters": 5, "3lc-s": 1.5, "error-feedback": False})
    assert c.describe() == (
        "uplink sbc {'id': 'sbc', 'p': 0.1, 'mode': 'fast'}, downlink 3lc {'id': '3lc', 's': 1.5, 'zero_run': True}, "
        "local iterations 5, error feedback False, tensors under 1000 values dense; "
        "schedules (round 1's values above): sbc-p list:0.1,0.2"
    )
    assert "schedules" not in _config(**{"sbc-p": 0.1}).describe()


def test_defaults_are_logged_when_the_run_config_sets_no_compression_key(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        c = CompressionConfig.from_run_config({"lr": 0.1})
    assert c == CompressionConfig()
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [
        "fedcomp: the run config sets no compression keys: fedcomp's defaults apply (a key your app's "
        "[tool.flwr.app.config] declares can be set with --run-config)"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        CompressionConfig.from_run_config({"sbc-p": 0.02})
    assert not caplog.records


def test_bandwidth_budget_carries_every_setting() -> None:
    c = _config(
        **{
            "round-deadline-s": 2.5,
            "uplink-budget-bytes": 900,
            "sbc-p-min": 0.002,
            "sbc-p-max": 0.2,
            "local-iters-min": 2,
            "local-iters-max": 50,
            "adapt-local-iters": True,
            "link-profiles": "10,20,5",
            "seconds-per-iter": 0.25,
        }
    )
    b = c.bandwidth_budget()
    assert (b.round_deadline_s, b.uplink_budget_bytes, b.p_min, b.p_max) == (2.5, 900, 0.002, 0.2)
    assert (b.local_iters_min, b.local_iters_max, b.adapt_local_iters) == (2, 50, True)
    assert (b.policy, b.link_profiles, b.seconds_per_iter) == ("constant-total-sparsity", "10,20,5", 0.25)


# --- DEFT and GradiVeQ entry points -------------------------------------------------------------------


def test_a_deft_train_round_needs_the_clients_allocation() -> None:
    rnd = ClientRound(
        codec_config={"id": "topk", "p": 0.05},
        replica={"w": torch.zeros(2000)},
        min_numel=1000,
        server_round=1,
        extras={},
        state=_Store(),
    )
    with pytest.raises(PayloadError) as info:
        DeftUplink.client_codecs(rnd)
    assert str(info.value) == "payload: a DEFT round came without this client's allocation"


def test_a_deft_allocation_for_another_round_is_refused() -> None:
    strategy, client = make_strategy(**{"uplink-codec": "deft", "topk-density": 0.05}), Client(1)
    (msg,) = strategy.configure_train(2, record_from_tensors(tiny_model()), ConfigRecord({}), FixedGrid([1]))
    config = dict(msg.content.config_records["config"])
    config[protocol.SERVER_ROUND] = 3  # a replayed or misrouted allocation
    msg.content["config"] = ConfigRecord(config)
    reply = client.handle(msg)
    assert reply.has_error() and reply.error.code == int(protocol.ErrorCode.RESYNC)
    assert "round" in reply.error.reason
    assert client.calls == 0


def test_gradiveq_clients_send_dense_until_the_server_fits() -> None:
    assert GradiVeQUplink.codec_config(_config(), 1) == {"id": "dense-fp32"}
    assert GradiVeQUplink.codec_config(_config(), 7) == {"id": "dense-fp32"}


def test_a_misspelt_compression_key_in_an_own_app_is_named_with_the_key_it_resembles(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run config also holds the app's own keys, so an unknown key is no error in library use;
    but one close to a compression key ("sbc-pp") says which (it was ignored silently)."""
    with caplog.at_level(logging.WARNING, logger="flwr.fedcomp"):
        cfg = CompressionConfig.from_run_config({"sbc-pp": 0.01, "lr": 0.1, "local-epochs": 1, "batch-size": 32})
    assert cfg.sbc_p.at(1) == CompressionConfig().sbc_p.at(1)
    assert [r.getMessage() for r in caplog.records] == [
        "fedcomp: run config key 'sbc-pp' is not a compression key and is ignored here; did you mean 'sbc-p'?"
    ]
