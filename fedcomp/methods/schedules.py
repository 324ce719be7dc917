"""Per-round schedules for temporal sparsity (local iterations), gradient sparsity p and 3LC's s.

Flower run config values are scalars, so a schedule is written as a number or a short string:

* ``0.01`` or ``"0.01"`` — constant;
* ``"steps:0.01@1,0.001@5,0.0005@10"`` — each value holds from its round on (rounds start at 1;
  the first step must be at round 1);
* ``"list:0.01,0.005,0.001"`` — one value per round, the last one repeated after the list ends.
"""

from __future__ import annotations

import bisect
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class Schedule(BaseModel):
    """A value per round, parsed from the forms above (``Schedule.parse``)."""

    model_config = ConfigDict(frozen=True)

    kind: str  # "constant" | "steps" | "list"
    values: tuple[float, ...]
    rounds: tuple[int, ...] = ()  # step starts, for kind "steps"

    @model_validator(mode="after")
    def _check(self) -> Schedule:
        if self.kind not in ("constant", "steps", "list"):
            raise ValueError(f"unknown schedule kind {self.kind!r}")
        if not self.values:
            raise ValueError("a schedule needs at least one value")
        if self.kind == "constant" and len(self.values) != 1:
            raise ValueError("a constant schedule has one value")
        if self.kind == "steps":
            if len(self.rounds) != len(self.values):
                raise ValueError("each step needs a round")
            if self.rounds[0] != 1:
                raise ValueError("the first step must start at round 1")
            if any(b <= a for a, b in zip(self.rounds, self.rounds[1:], strict=False)):
                raise ValueError("step rounds must increase")
        return self

    @classmethod
    def parse(cls, spec: Any) -> Schedule:
        if isinstance(spec, Schedule):
            return spec
        if isinstance(spec, bool):
            raise ValueError(f"not a schedule: {spec!r}")
        if isinstance(spec, int | float):
            return cls(kind="constant", values=(float(spec),))
        if not isinstance(spec, str):
            raise ValueError(f"not a schedule: {spec!r}")
        text = spec.strip()
        try:
            if text.startswith("steps:"):
                rounds, values = [], []
                for part in text[6:].split(","):
                    v, r = part.split("@")
                    values.append(float(v))
                    rounds.append(int(r))
                return cls(kind="steps", values=tuple(values), rounds=tuple(rounds))
            if text.startswith("list:"):
                return cls(kind="list", values=tuple(float(v) for v in text[5:].split(",")))
            if text.startswith("const:"):
                text = text[6:]
            return cls(kind="constant", values=(float(text),))
        except ValueError as exc:
            if "could not convert" in str(exc) or "not enough values" in str(exc) or "invalid literal" in str(exc):
                raise ValueError(
                    f"cannot parse schedule {spec!r}: use a number, 'steps:V@R,V@R,...' or 'list:V,V,...'"
                ) from None
            raise

    def at(self, server_round: int) -> float:
        """The value for ``server_round`` (1-based)."""
        if server_round < 1:
            raise ValueError(f"rounds start at 1, got {server_round}")
        if self.kind == "constant":
            return self.values[0]
        if self.kind == "list":
            return self.values[min(server_round, len(self.values)) - 1]
        return self.values[bisect.bisect_right(self.rounds, server_round) - 1]

    def check_range(self, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> None:
        for v in self.values:
            bad = v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi)
            if bad:
                lb, hb = "(" if lo_open else "[", ")" if hi_open else "]"
                raise ValueError(f"value {v} is outside {lb}{lo}, {hi}{hb}")

    def __str__(self) -> str:
        if self.kind == "constant":
            return f"{self.values[0]:g}"
        if self.kind == "list":
            return "list:" + ",".join(f"{v:g}" for v in self.values)
        return "steps:" + ",".join(f"{v:g}@{r}" for v, r in zip(self.values, self.rounds, strict=True))
