"""The two records that cross the wire (DownlinkHeader, UplinkReport) and the client's state
records, field by field: what ``to_record`` writes, that ``from_record`` reads it back, and that
every malformed field is one PayloadError whose message names the record and the field.

The messages are asserted exactly: they are what an operator reads in a rejection or resync log.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from flwr.app import ConfigRecord

from fedcomp.errors import PayloadError
from fedcomp.flower import protocol
from fedcomp.flower.protocol import (
    MAX_UPLINK_EXTRA_BYTES,
    MAX_UPLINK_METHOD_FIELDS,
    DownlinkHeader,
    DownlinkMode,
    ReplicaMeta,
    UpdateStatus,
    UplinkReport,
)

DL_CODEC = {"id": "3lc", "s": 1.0}
UL_CODEC = {"id": "sbc", "p": 0.01}


def _header(**change: Any) -> DownlinkHeader:
    values: dict[str, Any] = {
        "mode": DownlinkMode.CHAIN,
        "payloads": (b"abc", b"defgh"),
        "version": 7,
        "digest": "d" * 32,
        "arrays_key": "arrays",
        "config_key": "config",
        "downlink_codec": dict(DL_CODEC),
        "uplink_codec": dict(UL_CODEC),
        "uplink_method": "sbc",
        "error_feedback": True,
        "min_compress_numel": 1000,
        "device": "cpu",
        "bandwidth": '{"policy": "none"}',
        "extras": {"deft.allocation": b"\x01\x02\x03\x04"},
    }
    values.update(change)
    return DownlinkHeader(**values)


def _dl_record(drop: tuple[str, ...] = (), **change: Any) -> dict[str, Any]:
    rec = dict(_header().to_record())
    for k in drop:
        del rec[k]
    rec.update(change)
    return rec


def _dl_error(rec: dict[str, Any]) -> str:
    with pytest.raises(PayloadError) as info:
        DownlinkHeader.from_record(ConfigRecord(rec) if _is_config_record_able(rec) else rec)
    assert info.value.tensor == ""
    return str(info.value)


def _is_config_record_able(rec: dict[str, Any]) -> bool:
    try:
        ConfigRecord(rec)
    except Exception:
        return False
    return True


# --- small helpers ------------------------------------------------------------------------------


def test_state_key_and_extra_key_are_namespaced_by_the_method_id() -> None:
    assert protocol.state_key("deft") == "fedcomp.method.deft"
    assert protocol.extra_key("deft", "allocation") == "deft.allocation"


def test_the_resync_code_is_flowers_failed_precondition() -> None:
    from flwr.common.constant import ErrorCode as FlowerErrorCode

    assert int(protocol.ErrorCode.RESYNC) == int(FlowerErrorCode.MOD_FAILED_PRECONDITION)


# --- DownlinkHeader -----------------------------------------------------------------------------


def test_downlink_to_record_writes_every_field_under_its_wire_name() -> None:
    rec = _header().to_record()
    assert dict(rec) == {
        "mode": "chain",
        "payloads": [b"abc", b"defgh"],
        "version": 7,
        "digest": "d" * 32,
        "arrays-key": "arrays",
        "config-key": "config",
        "downlink-codec": json.dumps(DL_CODEC, separators=(",", ":")),  # (compact: it crosses the wire)
        "uplink-codec": json.dumps(UL_CODEC, separators=(",", ":")),
        "uplink-method": "sbc",
        "error-feedback": True,
        "min-compress-numel": 1000,
        "device": "cpu",
        "bandwidth": '{"policy": "none"}',
        "deft.allocation": b"\x01\x02\x03\x04",
    }
    assert type(rec["mode"]) is str


@pytest.mark.parametrize("mode", list(DownlinkMode))
def test_downlink_round_trips(mode: DownlinkMode) -> None:
    header = _header(mode=mode, error_feedback=False, extras={"a.x": b"1", "b.y": b""})
    back = DownlinkHeader.from_record(header.to_record())
    assert back == header
    assert back.mode is mode
    assert isinstance(back.payloads, tuple)


def test_downlink_round_trips_without_extras_or_payloads() -> None:
    header = _header(mode=DownlinkMode.NONE, payloads=(), extras={})
    back = DownlinkHeader.from_record(header.to_record())
    assert back == header and back.extras == {} and back.payloads == ()


def test_downlink_nbytes_counts_payloads_and_extras() -> None:
    assert _header().nbytes == 3 + 5 + 4
    assert _header(payloads=(), extras={}).nbytes == 0
    assert _header(payloads=(b"x" * 10,), extras={"m.a": b"y" * 3, "m.b": b"z" * 2}).nbytes == 15


def test_an_extra_after_the_fields_is_still_read() -> None:
    rec = {"m.extra": b"\x09", **_dl_record(), "z.last": b"\x0a\x0b"}
    back = DownlinkHeader.from_record(rec)
    assert back.extras == {"m.extra": b"\x09", "deft.allocation": b"\x01\x02\x03\x04", "z.last": b"\x0a\x0b"}


@pytest.mark.parametrize("field", DownlinkHeader._FIELDS)
def test_a_missing_downlink_field_is_named(field: str) -> None:
    assert _dl_error(_dl_record(drop=(field,))) == f"payload: downlink: field {field!r} is missing"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("mode", 3, "field 'mode' must be str, got int"),
        ("payloads", b"abc", "field 'payloads' must be list, got bytes"),
        ("version", "7", "field 'version' must be int, got str"),
        ("version", 7.0, "field 'version' must be int, got float"),
        ("version", True, "field 'version' must be int, got bool"),
        ("digest", 5, "field 'digest' must be str, got int"),
        ("arrays-key", 1.5, "field 'arrays-key' must be str, got float"),
        ("config-key", b"c", "field 'config-key' must be str, got bytes"),
        ("downlink-codec", 3, "field 'downlink-codec' must be str, got int"),
        ("uplink-codec", True, "field 'uplink-codec' must be str, got bool"),
        ("uplink-method", 2, "field 'uplink-method' must be str, got int"),
        ("error-feedback", 1, "field 'error-feedback' must be bool, got int"),
        ("error-feedback", "yes", "field 'error-feedback' must be bool, got str"),
        ("min-compress-numel", False, "field 'min-compress-numel' must be int, got bool"),
        ("min-compress-numel", 2.5, "field 'min-compress-numel' must be int, got float"),
        ("device", 0, "field 'device' must be str, got int"),
        ("bandwidth", b"{}", "field 'bandwidth' must be str, got bytes"),
    ],
)
def test_a_downlink_field_of_the_wrong_type_is_named(field: str, value: Any, message: str) -> None:
    assert _dl_error(_dl_record(**{field: value})) == f"payload: downlink: {message}"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mode": "partial"}, "unknown mode 'partial'"),
        ({"mode": "FULL"}, "unknown mode 'FULL'"),
        ({"payloads": [b"a", "b"]}, "field 'payloads' must be a list of bytes"),
        ({"payloads": [1]}, "field 'payloads' must be a list of bytes"),
        ({"bogus": b"x"}, "unexpected field 'bogus'"),
        ({"bogus": 1}, "unexpected field 'bogus'"),
        ({"m.extra": "text"}, "unexpected field 'm.extra'"),
        ({"m.extra": 5}, "unexpected field 'm.extra'"),
        (
            {"downlink-codec": "{not json"},
            "field 'downlink-codec' is not JSON (Expecting property name enclosed in double quotes)",
        ),
        ({"uplink-codec": ""}, "field 'uplink-codec' is not JSON (Expecting value)"),
        ({"uplink-codec": "[1, 2]"}, "field 'uplink-codec' must be a codec config with a string 'id'"),
        ({"uplink-codec": '{"p": 0.1}'}, "field 'uplink-codec' must be a codec config with a string 'id'"),
        ({"downlink-codec": '{"id": 3}'}, "field 'downlink-codec' must be a codec config with a string 'id'"),
        ({"downlink-codec": '"3lc"'}, "field 'downlink-codec' must be a codec config with a string 'id'"),
    ],
)
def test_a_malformed_downlink_is_one_payload_error(change: dict[str, Any], message: str) -> None:
    assert _dl_error(_dl_record(**change)) == f"payload: downlink: {message}"


def test_downlink_codec_configs_are_read_as_json() -> None:
    back = DownlinkHeader.from_record(
        _dl_record(**{"downlink-codec": '{"id": "3lc", "s": 2.0}', "uplink-codec": '{"id": "topk", "p": 0.5}'})
    )
    assert back.downlink_codec == {"id": "3lc", "s": 2.0}
    assert back.uplink_codec == {"id": "topk", "p": 0.5}


# --- UplinkReport ---------------------------------------------------------------------------------


def _full_report(**change: Any) -> UplinkReport:
    values: dict[str, Any] = {
        "replica_version": 4,
        "replica_digest": "a" * 32,
        "payload": b"\x00\x01\x02",
        "encode_seconds": 0.25,
        "train_seconds": 1.5,
        "device": "cpu",
        "codec": "sbc",
        "sbc_p": 0.01,
        "local_iters": 3,
        "budget_bytes": 5000,
        "estimated_bytes": 4000,
        "fits": True,
        "link": (10.0, 50.0, 20.0),
        "residual_norm": 0.5,
        "update_norm": 2.0,
        "status": {"gradiveq.version": 2},
    }
    values.update(change)
    return UplinkReport(**values)


FULL_RECORD = {
    "replica-version": 4,
    "replica-digest": "a" * 32,
    "payload": b"\x00\x01\x02",
    "encode-seconds": 0.25,
    "train-seconds": 1.5,
    "device": "cpu",
    "codec": "sbc",
    "sbc-p": 0.01,
    "local-iters": 3,
    "budget-bytes": 5000,
    "estimated-bytes": 4000,
    "fits": True,
    "residual-norm": 0.5,
    "update-norm": 2.0,
    "uplink-mbps": 10.0,
    "downlink-mbps": 50.0,
    "latency-ms": 20.0,
    "gradiveq.version": 2,
}


def _ul_error(rec: dict[str, Any]) -> str:
    with pytest.raises(PayloadError) as info:
        UplinkReport.from_record(rec)
    assert info.value.tensor == ""
    return str(info.value)


def test_uplink_to_record_writes_every_field_under_its_wire_name() -> None:
    assert dict(_full_report().to_record()) == FULL_RECORD


def test_uplink_to_record_omits_only_what_is_none() -> None:
    assert dict(UplinkReport(3, "b" * 32).to_record()) == {"replica-version": 3, "replica-digest": "b" * 32}
    # Falsy values are values: an empty payload, zero seconds, p = 0, no iterations, fits False.
    falsy = UplinkReport(
        0,
        "",
        payload=b"",
        encode_seconds=0.0,
        train_seconds=0.0,
        device="",
        sbc_p=0.0,
        local_iters=0,
        budget_bytes=0,
        estimated_bytes=0,
        fits=False,
        link=(0.0, 0.0, 0.0),
        residual_norm=0.0,
        update_norm=0.0,
    )
    rec = dict(falsy.to_record())
    assert rec == {
        "replica-version": 0,
        "replica-digest": "",
        "payload": b"",
        "encode-seconds": 0.0,
        "train-seconds": 0.0,
        "device": "",
        "sbc-p": 0.0,
        "local-iters": 0,
        "budget-bytes": 0,
        "estimated-bytes": 0,
        "fits": False,
        "residual-norm": 0.0,
        "update-norm": 0.0,
        "uplink-mbps": 0.0,
        "downlink-mbps": 0.0,
        "latency-ms": 0.0,
    }
    assert UplinkReport.from_record(rec) == falsy


@pytest.mark.parametrize("key", ["device", "codec"])
def test_uplink_names_longer_than_64_characters_are_refused(key: str) -> None:
    assert UplinkReport.from_record({**FULL_RECORD, key: "x" * 64}) == _full_report(**{key: "x" * 64})
    assert _ul_error({**FULL_RECORD, key: "x" * 65}).endswith(f"uplink: field {key!r} is longer than 64 characters")
    assert "must be str" in _ul_error({**FULL_RECORD, key: 7})


def test_the_link_is_written_as_floats() -> None:
    rec = UplinkReport(1, "x", link=(10, 50, 20)).to_record()  # type: ignore[arg-type]
    assert [(rec[k], type(rec[k])) for k in ("uplink-mbps", "downlink-mbps", "latency-ms")] == [
        (10.0, float),
        (50.0, float),
        (20.0, float),
    ]


def test_uplink_round_trips() -> None:
    report = _full_report()
    back = UplinkReport.from_record(report.to_record())
    assert back == report
    assert back.link == (10.0, 50.0, 20.0) and isinstance(back.link, tuple)
    minimal = UplinkReport(0, "c")
    back = UplinkReport.from_record(minimal.to_record())
    assert back == minimal and back.link is None and back.status == {}


def test_uplink_numbers_may_be_ints_and_are_read_as_floats() -> None:
    rec = {
        **FULL_RECORD,
        "encode-seconds": 1,
        "train-seconds": 2,
        "sbc-p": 0,
        "residual-norm": 6,
        "update-norm": 7,
        "uplink-mbps": 3,
        "downlink-mbps": 4,
        "latency-ms": 5,
    }
    back = UplinkReport.from_record(rec)
    got = (back.encode_seconds, back.train_seconds, back.sbc_p, back.residual_norm, back.update_norm, back.link)
    assert got == (1.0, 2.0, 0.0, 6.0, 7.0, (3.0, 4.0, 5.0))
    floats = (back.encode_seconds, back.train_seconds, back.sbc_p, back.residual_norm, back.update_norm, *back.link)  # type: ignore[misc]
    assert all(type(x) is float for x in floats)


def test_uplink_status_values_are_kept() -> None:
    back = UplinkReport.from_record({"replica-version": 1, "replica-digest": "x", "m.a": 0, "n.b": -3})
    assert back.status == {"m.a": 0, "n.b": -3}
    assert dict(UplinkReport(1, "x", status={"m.a": 0}).to_record()) == {
        "replica-version": 1,
        "replica-digest": "x",
        "m.a": 0,
    }


def test_uplink_method_bytes_are_kept_up_to_their_cap() -> None:
    back = UplinkReport.from_record({"replica-version": 1, "replica-digest": "x", "m.raw": b"ab", "m.a": 2})
    assert (back.extras, back.status) == ({"m.raw": b"ab"}, {"m.a": 2})
    assert dict(UplinkReport(1, "x", extras={"m.raw": b"ab"}).to_record()) == {
        "replica-version": 1,
        "replica-digest": "x",
        "m.raw": b"ab",
    }
    half = b"\0" * (MAX_UPLINK_EXTRA_BYTES // 2)
    UplinkReport.from_record({"replica-version": 1, "replica-digest": "x", "m.a": half, "m.b": half})
    too_many = {"replica-version": 1, "replica-digest": "x", "m.a": half, "m.b": half + b"\0"}
    assert _ul_error(too_many) == f"payload: uplink: a method's fields hold more than {MAX_UPLINK_EXTRA_BYTES} bytes"
    fields = {f"m.k{i}": (b"" if i % 2 else i) for i in range(MAX_UPLINK_METHOD_FIELDS)}
    UplinkReport.from_record({"replica-version": 1, "replica-digest": "x", **fields})
    fields["m.one-more"] = 1
    assert _ul_error({"replica-version": 1, "replica-digest": "x", **fields}) == (
        f"payload: uplink: more than {MAX_UPLINK_METHOD_FIELDS} fields of a method's own"
    )


@pytest.mark.parametrize("field", ["replica-version", "replica-digest"])
def test_a_missing_replica_field_is_named(field: str) -> None:
    rec = {k: v for k, v in FULL_RECORD.items() if k != field}
    assert _ul_error(rec) == f"payload: uplink: field {field!r} is missing"


@pytest.mark.parametrize("field", ["uplink-mbps", "downlink-mbps", "latency-ms"])
def test_a_partial_link_is_named(field: str) -> None:
    rec = {k: v for k, v in FULL_RECORD.items() if k != field}
    assert _ul_error(rec) == f"payload: uplink: field {field!r} is missing"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("replica-version", "4", "field 'replica-version' must be int, got str"),
        ("replica-version", True, "field 'replica-version' must be int, got bool"),
        ("replica-digest", 4, "field 'replica-digest' must be str, got int"),
        ("payload", "bytes", "field 'payload' must be bytes, got str"),
        ("encode-seconds", "1", "field 'encode-seconds' must be int or float, got str"),
        ("encode-seconds", True, "field 'encode-seconds' must be int or float, got bool"),
        ("train-seconds", b"1", "field 'train-seconds' must be int or float, got bytes"),
        ("device", 1, "field 'device' must be str, got int"),
        ("sbc-p", "fast", "field 'sbc-p' must be int or float, got str"),
        ("local-iters", 2.0, "field 'local-iters' must be int, got float"),
        ("local-iters", False, "field 'local-iters' must be int, got bool"),
        ("budget-bytes", 1.5, "field 'budget-bytes' must be int, got float"),
        ("estimated-bytes", "9", "field 'estimated-bytes' must be int, got str"),
        ("fits", 3, "field 'fits' must be bool, got int"),
        ("fits", "yes", "field 'fits' must be bool, got str"),
        ("uplink-mbps", "10", "field 'uplink-mbps' must be int or float, got str"),
        ("latency-ms", False, "field 'latency-ms' must be int or float, got bool"),
        ("residual-norm", "1", "field 'residual-norm' must be int or float, got str"),
        ("update-norm", b"", "field 'update-norm' must be int or float, got bytes"),
    ],
)
def test_an_uplink_field_of_the_wrong_type_is_named(field: str, value: Any, message: str) -> None:
    assert _ul_error({**FULL_RECORD, field: value}) == f"payload: uplink: {message}"


@pytest.mark.parametrize(
    ("key", "value"),
    [("bogus", 1), ("m.flag", True), ("m.ratio", 0.5), ("m.name", "x"), ("nodot", b"x")],
)
def test_an_unexpected_uplink_field_is_named(key: str, value: Any) -> None:
    assert _ul_error({**FULL_RECORD, key: value}) == f"payload: uplink: unexpected field {key!r}"


def test_an_unexpected_uplink_field_after_the_known_ones_is_caught() -> None:
    rec = {"m.ok": 1, **FULL_RECORD, "late": 2}
    assert _ul_error(rec) == "payload: uplink: unexpected field 'late'"


# --- client state records -------------------------------------------------------------------------


def test_replica_meta_round_trips() -> None:
    meta = ReplicaMeta(5, "e" * 32)
    assert dict(meta.to_record()) == {"version": 5, "digest": "e" * 32}
    assert ReplicaMeta.from_record(meta.to_record()) == meta


@pytest.mark.parametrize(
    ("rec", "message"),
    [
        ({"digest": "x"}, "field 'version' is missing"),
        ({"version": 1}, "field 'digest' is missing"),
        ({"version": "1", "digest": "x"}, "field 'version' must be int, got str"),
        ({"version": 1, "digest": 2}, "field 'digest' must be str, got int"),
    ],
)
def test_a_malformed_replica_meta_is_named(rec: dict[str, Any], message: str) -> None:
    with pytest.raises(PayloadError) as info:
        ReplicaMeta.from_record(rec)
    assert str(info.value) == f"payload: state: {message}"


def test_seconds_per_iter_round_trips_through_its_record() -> None:
    rec = protocol.seconds_per_iter_record(2)
    assert dict(rec) == {"seconds-per-iter": 2.0} and type(rec["seconds-per-iter"]) is float
    got = protocol.measured_seconds_per_iter(rec)
    assert got == 2.0 and type(got) is float
    assert protocol.measured_seconds_per_iter(protocol.seconds_per_iter_record(0.125)) == 0.125


def test_no_measured_seconds_per_iter_is_zero() -> None:
    for rec in (None, ConfigRecord({}), ConfigRecord({"other": 1.0})):
        got = protocol.measured_seconds_per_iter(rec)
        assert got == 0.0 and type(got) is float
    got = protocol.measured_seconds_per_iter({"seconds-per-iter": 3})
    assert got == 3.0 and type(got) is float


def test_a_malformed_seconds_per_iter_is_named() -> None:
    with pytest.raises(PayloadError) as info:
        protocol.measured_seconds_per_iter({"seconds-per-iter": "fast"})
    assert str(info.value) == "payload: state: field 'seconds-per-iter' must be int or float, got str"


def test_a_link_of_the_wrong_length_is_not_written() -> None:
    with pytest.raises(ValueError):
        UplinkReport(1, "x", link=(1.0, 2.0)).to_record()  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        UplinkReport(1, "x", link=(1.0, 2.0, 3.0, 4.0)).to_record()  # type: ignore[arg-type]


def test_the_unsettled_updates_table_finds_a_node_and_refuses_malformed_rows() -> None:
    from fedcomp.flower.protocol import MAX_UNSETTLED_ROWS, pack_unsettled, unsettled_record

    rows = [(2**64 - 1, 7, UpdateStatus.REJECTED), (5, 0, UpdateStatus.NONE), (9, 3, UpdateStatus.AGGREGATED)]
    table = pack_unsettled(rows)
    assert len(table) == 13 * 3
    assert unsettled_record(table, 2**64 - 1) == (7, UpdateStatus.REJECTED)
    assert unsettled_record(table, 5) == (0, UpdateStatus.NONE)
    assert unsettled_record(table, 9) == (3, UpdateStatus.AGGREGATED)
    assert unsettled_record(table, 6) is None and unsettled_record(b"", 6) is None
    assert len(pack_unsettled([(n, 1, UpdateStatus.REJECTED) for n in range(MAX_UNSETTLED_ROWS + 5)])) == 13 * 4096
    for bad, what in (
        (table[:-1], "not rows of 13"),
        (table[:-1] + b"\x03", "malformed row for node 9"),  # status code 3
        (pack_unsettled([(4, 2, UpdateStatus.NONE)]), "malformed row for node 4"),  # none with a round
        (pack_unsettled([(4, 0, UpdateStatus.REJECTED)]), "malformed row for node 4"),
        (b"\x00" * 13 * (MAX_UNSETTLED_ROWS + 1), "more than 4096 rows"),
    ):
        with pytest.raises(PayloadError, match=what):
            unsettled_record(bad, 1)
