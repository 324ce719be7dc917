"""Protocol 2's new fields, field by field: the update outcome in the downlink (a typed view that
names every bad field), the protocol version, the ``update-round`` echo in the uplink, and the
client's verdict rules. Messages are asserted exactly: they are what an operator reads."""

from __future__ import annotations

from typing import Any

import pytest

from fedcomp.errors import PayloadError
from fedcomp.flower.protocol import (
    MAX_REASON_CHARS,
    PROTOCOL_VERSION,
    DownlinkHeader,
    DownlinkMode,
    UpdateOutcome,
    UpdateStatus,
    UplinkReport,
)

OUTCOME = UpdateOutcome(round=7, settled_round=6, last_update_round=5, last_update_status=UpdateStatus.REJECTED,
                        last_update_reason="payload: update norm 9 exceeds max-update-norm 5")  # fmt: skip


def _header(outcome: UpdateOutcome | None = OUTCOME) -> DownlinkHeader:
    return DownlinkHeader(
        mode=DownlinkMode.NONE,
        payloads=(),
        version=3,
        digest="d" * 32,
        arrays_key="arrays",
        config_key="config",
        downlink_codec={"id": "3lc", "s": 1.0},
        uplink_codec={"id": "sbc", "p": 0.05},
        uplink_method="sbc",
        error_feedback=True,
        min_compress_numel=1000,
        device="cpu",
        bandwidth='{"policy": "none"}',
        extras={"deft.allocation": b"\x01"},
        outcome=outcome,
    )


def _record(**change: Any) -> dict[str, Any]:
    rec = dict(_header().to_record())
    for k, v in change.items():
        if v is None:
            del rec[k]
        else:
            rec[k] = v
    return rec


def _error(rec: dict[str, Any]) -> str:
    with pytest.raises(PayloadError) as info:
        DownlinkHeader.from_record(rec)
    assert info.value.tensor == ""
    return str(info.value)


def test_protocol_2_writes_the_version_and_the_outcome_fields() -> None:
    rec = _header().to_record()
    assert PROTOCOL_VERSION == 2
    assert {k: rec[k] for k in ("protocol", *UpdateOutcome._FIELDS)} == {
        "protocol": 2,
        "round": 7,
        "settled-round": 6,
        "last-update-round": 5,
        "last-update-status": "rejected",
        "last-update-reason": "payload: update norm 9 exceeds max-update-norm 5",
        "records-from-round": 1,
    }
    back = DownlinkHeader.from_record(rec)
    assert back == _header() and back.protocol == 2 and back.outcome == OUTCOME
    assert back.extras == {"deft.allocation": b"\x01"}  # the outcome is no method extra
    assert back.nbytes == 1  # nor model traffic


def test_a_protocol_1_downlink_has_no_outcome_and_reads_as_before() -> None:
    rec = dict(_header(None).to_record())
    assert "protocol" not in rec and not set(UpdateOutcome._FIELDS) & set(rec)
    back = DownlinkHeader.from_record(rec)
    assert back.outcome is None and back.protocol == 1
    assert DownlinkHeader.from_record({**rec, "protocol": 1}).outcome is None


@pytest.mark.parametrize("field", UpdateOutcome._FIELDS)
def test_a_protocol_1_downlink_with_an_outcome_field_names_it(field: str) -> None:
    rec = {**dict(_header(None).to_record()), field: _header().to_record()[field]}
    assert _error(rec) == f"payload: downlink: unexpected field {field!r}"


@pytest.mark.parametrize("field", UpdateOutcome._FIELDS)
def test_a_missing_outcome_field_is_named(field: str) -> None:
    assert _error(_record(**{field: None})) == f"payload: downlink: field {field!r} is missing"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("protocol", "2", "field 'protocol' must be int, got str"),
        ("protocol", True, "field 'protocol' must be int, got bool"),
        ("protocol", 3, "field 'protocol' is 3; this client speaks 1 and 2"),
        ("protocol", 0, "field 'protocol' is 0; this client speaks 1 and 2"),
        ("round", 7.0, "field 'round' must be int, got float"),
        ("round", -1, "field 'round' must be >= 0, got -1"),
        ("settled-round", "6", "field 'settled-round' must be int, got str"),
        ("settled-round", -2, "field 'settled-round' must be >= 0, got -2"),
        ("last-update-round", False, "field 'last-update-round' must be int, got bool"),
        ("last-update-round", -5, "field 'last-update-round' must be >= 0, got -5"),
        ("last-update-round", 8, "field 'last-update-round' = 8 is after 'settled-round' = 6"),
        ("last-update-round", 0, "field 'last-update-status' is 'rejected' with 'last-update-round' = 0"),
        ("last-update-status", 1, "field 'last-update-status' must be str, got int"),
        (
            "last-update-status",
            "lost",
            "field 'last-update-status' is 'lost', not one of ['aggregated', 'rejected', 'none']",
        ),
        ("last-update-status", "none", "field 'last-update-status' is 'none' with 'last-update-round' = 5"),
        ("last-update-status", "aggregated", "field 'last-update-reason' is set for a 'aggregated' update"),
        ("last-update-reason", b"x", "field 'last-update-reason' must be str, got bytes"),
        ("records-from-round", "1", "field 'records-from-round' must be int, got str"),
        ("records-from-round", -1, "field 'records-from-round' must be >= 0, got -1"),
        ("records-from-round", 8, "field 'records-from-round' = 8 is after 'settled-round' + 1 = 7"),
        ("records-from-round", 6, "field 'last-update-round' = 5 is before 'records-from-round' = 6"),
        (
            "last-update-reason",
            "x" * (MAX_REASON_CHARS + 1),
            f"field 'last-update-reason' is longer than {MAX_REASON_CHARS} characters",
        ),
    ],
)
def test_a_bad_outcome_field_is_one_payload_error_naming_it(field: str, value: Any, message: str) -> None:
    assert _error(_record(**{field: value})) == f"payload: downlink: {message}"


def test_the_longest_reason_and_a_first_contact_outcome_are_valid() -> None:
    long = UpdateOutcome(3, 2, 2, UpdateStatus.REJECTED, "r" * MAX_REASON_CHARS)
    assert DownlinkHeader.from_record(_header(long).to_record()).outcome == long
    first = UpdateOutcome(1, 0, 0, UpdateStatus.NONE)
    assert DownlinkHeader.from_record(_header(first).to_record()).outcome == first
    restarted = UpdateOutcome(7, 6, 0, UpdateStatus.NONE, records_from_round=7)  # no record yet
    assert DownlinkHeader.from_record(_header(restarted).to_record()).outcome == restarted


@pytest.mark.parametrize(
    ("outcome", "update_round", "train", "verdict"),
    [
        # Settled: aggregated iff it is the recorded update and that one was aggregated.
        (UpdateOutcome(5, 4, 4, UpdateStatus.AGGREGATED), 4, True, True),
        (UpdateOutcome(5, 4, 4, UpdateStatus.AGGREGATED), 4, False, True),
        (UpdateOutcome(5, 4, 4, UpdateStatus.REJECTED, "why"), 4, True, False),
        (UpdateOutcome(5, 4, 3, UpdateStatus.AGGREGATED), 4, True, False),  # round 4's never arrived
        (UpdateOutcome(5, 4, 0, UpdateStatus.NONE), 2, False, False),  # nothing ever arrived
        (UpdateOutcome(9, 8, 8, UpdateStatus.AGGREGATED), 4, True, False),  # a later one is on record
        # Not settled: an evaluate message waits; a train message means the server went back.
        (UpdateOutcome(4, 4, 3, UpdateStatus.AGGREGATED), 5, False, None),
        (UpdateOutcome(5, 4, 3, UpdateStatus.AGGREGATED), 5, True, False),
        (UpdateOutcome(3, 2, 2, UpdateStatus.AGGREGATED), 5, True, False),
        # Before the server's records begin (it restarted without them): unknown, counted as
        # aggregated; from their first round on, the rules above.
        (UpdateOutcome(7, 6, 0, UpdateStatus.NONE, records_from_round=6), 5, True, True),
        (UpdateOutcome(7, 6, 0, UpdateStatus.NONE, records_from_round=6), 5, False, True),
        (UpdateOutcome(7, 6, 0, UpdateStatus.NONE, records_from_round=6), 6, True, False),
        (UpdateOutcome(6, 5, 0, UpdateStatus.NONE, records_from_round=6), 6, True, False),
    ],
)
def test_the_verdict_rules(outcome: UpdateOutcome, update_round: int, train: bool, verdict: bool | None) -> None:
    assert outcome.verdict(update_round, train) is verdict


def test_the_uplink_echo_round_trips_and_is_type_checked() -> None:
    report = UplinkReport(3, "x", payload=b"p", update_round=7)
    rec = report.to_record()
    assert rec["update-round"] == 7
    assert UplinkReport.from_record(rec) == report
    assert "update-round" not in UplinkReport(3, "x").to_record()
    for value, kind in (("7", "str"), (7.0, "float"), (True, "bool")):
        with pytest.raises(PayloadError) as info:
            UplinkReport.from_record({**dict(rec), "update-round": value})
        assert str(info.value) == f"payload: uplink: field 'update-round' must be int, got {kind}"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("replica-version", -1),
        ("encode-seconds", float("nan")),
        ("train-seconds", float("inf")),
        ("train-seconds", -0.5),
        ("sbc-p", -0.01),
        ("local-iters", -3),
        ("budget-bytes", -1),
        ("estimated-bytes", -10),
        ("residual-norm", float("nan")),
        ("update-norm", float("-inf")),
        ("update-round", -1),
        ("uplink-mbps", float("inf")),
        ("latency-ms", -5.0),
    ],
)
def test_an_uplink_number_out_of_range_is_named(field: str, value: Any) -> None:
    rec = {"replica-version": 1, "replica-digest": "x", "uplink-mbps": 1.0, "downlink-mbps": 1.0, "latency-ms": 1.0}
    with pytest.raises(PayloadError) as info:
        UplinkReport.from_record({**rec, field: value})
    assert str(info.value) == f"payload: uplink: field {field!r} must be finite and >= 0, got {value!r}"


def test_an_uplink_p_above_one_is_named() -> None:
    with pytest.raises(PayloadError) as info:
        UplinkReport.from_record({"replica-version": 1, "replica-digest": "x", "sbc-p": 1.5})
    assert str(info.value) == "payload: uplink: field 'sbc-p' must be <= 1, got 1.5"
    assert UplinkReport.from_record({"replica-version": 1, "replica-digest": "x", "sbc-p": 1}).sbc_p == 1.0
