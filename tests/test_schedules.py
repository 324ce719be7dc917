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
