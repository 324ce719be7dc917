import itertools

import pytest

from fedcomp.methods.schedules import Schedule


def test_constant_steps_and_list() -> None:
    assert [Schedule.parse(0.5).at(r) for r in (1, 7)] == [0.5, 0.5]
    steps = Schedule.parse("steps:0.01@1,0.001@5")
    assert [steps.at(r) for r in range(1, 8)] == [0.01] * 4 + [0.001] * 3
    lst = Schedule.parse("list:1,2,3")
    assert [lst.at(r) for r in range(1, 6)] == [1, 2, 3, 3, 3]
    for s in (steps, lst, Schedule.parse(0.25)):
        assert Schedule.parse(str(s)) == s  # the string form round-trips


@pytest.mark.parametrize(
    "spec, message",
    [
        ("steps:0.1@2", "first step must start at round 1"),
        ("steps:1@1,2@1", "step rounds must increase"),
        ("fast", "cannot parse schedule"),
        ("list:", "cannot parse schedule"),
        (True, "not a schedule"),
    ],
)
def test_bad_schedules(spec: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Schedule.parse(spec)


def test_round_zero_is_an_error() -> None:
    with pytest.raises(ValueError, match="rounds start at 1"):
        Schedule.parse(1).at(0)


def test_warmup_decays_exponentially_to_the_target_then_holds_it() -> None:
    w = Schedule.parse("warmup:0.05@4")
    values = [w.at(r) for r in range(1, 8)]
    assert values[0] == pytest.approx(0.25)  # DGC's first-epoch density when no start is named
    ratios = [b / a for a, b in itertools.pairwise(values[:5])]
    assert ratios == pytest.approx([(0.05 / 0.25) ** 0.25] * 4)  # one constant factor per round
    assert values[4:] == [0.05, 0.05, 0.05]
    named = Schedule.parse(" warmup:0.5>0.05@2 ")
    assert [named.at(r) for r in (1, 2, 3)] == pytest.approx([0.5, 0.5 * 0.1**0.5, 0.05])
    for s in (w, named):
        assert Schedule.parse(str(s)) == s


@pytest.mark.parametrize(
    "spec, message",
    [
        ("warmup:0.05", "needs '@ROUNDS'"),
        ("warmup:abc@4", "warm-up target 'abc' is not a number"),
        ("warmup:x>0.05@4", "warm-up start 'x' is not a number"),
        ("warmup:0.05@four", "warm-up rounds 'four' is not a whole number"),
        ("warmup:0.05@0", "warm-up rounds: 0 is not >= 1"),
        ("warmup:0.5>-0.05@3", "finite and > 0"),
        ("warmup:nan@3", "finite and > 0"),
    ],
)
def test_bad_warmups_name_the_bad_part(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Schedule.parse(spec)


def test_warmup_values_are_range_checked_like_the_others() -> None:
    from fedcomp.errors import ConfigError
    from fedcomp.methods.config import CompressionConfig

    assert CompressionConfig.from_run_config({"sbc-p": "warmup:0.05@4"}).sbc_p.at(5) == 0.05
    with pytest.raises(ConfigError, match=r"sbc-p: value 0.9 is outside"):
        CompressionConfig.from_run_config({"sbc-p": "warmup:0.9>0.05@4"})
