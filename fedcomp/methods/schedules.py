"""Per-round schedules for temporal sparsity (local iterations), gradient sparsity p and 3LC's s.

Flower run config values are scalars, so a schedule is written as a number or a short string:

* ``0.01`` or ``"0.01"`` — constant;
* ``"steps:0.01@1,0.001@5,0.0005@10"`` — each value holds from its round on (rounds start at 1;
  the first step must be at round 1);
* ``"list:0.01,0.005,0.001"`` — one value per round, the last one repeated after the list ends;
* ``"warmup:0.05@4"`` or ``"warmup:0.5>0.05@4"`` — Deep Gradient Compression's warm-up (Lin et al.
  2018): the value decays exponentially from a dense start (default 0.25, DGC's first-epoch
  density) to the target over the first 4 rounds, ``start * (target / start) ** ((r - 1) / 4)`` in
  round ``r``, then holds the target. Departures from the paper: DGC warms up over epochs and
  from 75 % sparsity to its target in factor-4 steps; here the unit is the server round and the
  curve runs exactly from ``start`` to ``target``, whatever their ratio. A start of 1.0 (dense)
  is not used because ``sbc-p`` accepts at most 0.5.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

#: Where a warm-up starts when its spec names no start: DGC's first-epoch density (75 % sparsity).
WARMUP_START = 0.25


class Schedule(BaseModel):
    """A value per round, parsed from the forms above (``Schedule.parse``)."""

    model_config = ConfigDict(frozen=True)

    kind: str  # "constant" | "steps" | "list" | "warmup"
    values: tuple[float, ...]  # for kind "warmup": (start, target)
    rounds: tuple[int, ...] = ()  # step starts, for kind "steps"; (warm-up rounds,) for "warmup"

    @model_validator(mode="after")
    def _check(self) -> Schedule:
        if self.kind not in ("constant", "steps", "list", "warmup"):
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
        if self.kind == "warmup":
            if len(self.values) != 2 or len(self.rounds) != 1:
                raise ValueError("a warm-up has a start, a target and a number of rounds")
            if self.rounds[0] < 1:
                raise ValueError(f"warm-up rounds: {self.rounds[0]} is not >= 1")
            if not all(v > 0 and math.isfinite(v) for v in self.values):
                raise ValueError(f"warm-up start and target must be finite and > 0, got {self.values}")
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
            if text.startswith("warmup:"):
                return cls._parse_warmup(text[7:], spec)
            if text.startswith("list:"):
                return cls(kind="list", values=tuple(float(v) for v in text[5:].split(",")))
            if text.startswith("const:"):
                text = text[6:]
            return cls(kind="constant", values=(float(text),))
        except ValueError as exc:
            if "could not convert" in str(exc) or "not enough values" in str(exc) or "invalid literal" in str(exc):
                raise ValueError(
                    f"cannot parse schedule {spec!r}: use a number, 'steps:V@R,V@R,...', 'list:V,V,...' "
                    "or 'warmup:[START>]TARGET@ROUNDS'"
                ) from None
            raise

    @classmethod
    def _parse_warmup(cls, body: str, spec: Any) -> Schedule:
        """``[START>]TARGET@ROUNDS``; errors name the part that is wrong."""
        values, at, rounds = body.partition("@")
        if not at:
            raise ValueError(f"schedule {spec!r}: a warm-up needs '@ROUNDS', e.g. 'warmup:0.05@4'")
        start_text, gt, target_text = values.rpartition(">")
        parts = {"target": target_text}
        if gt:
            parts["start"] = start_text
        parsed: dict[str, float] = {"start": WARMUP_START}
        for what, text in parts.items():
            try:
                parsed[what] = float(text)
            except ValueError:
                raise ValueError(f"schedule {spec!r}: warm-up {what} {text!r} is not a number") from None
        try:
            n = int(rounds)
        except ValueError:
            raise ValueError(f"schedule {spec!r}: warm-up rounds {rounds!r} is not a whole number") from None
        try:
            return cls(kind="warmup", values=(parsed["start"], parsed["target"]), rounds=(n,))
        except ValidationError as exc:  # keep only our message, not pydantic's report around it
            msg = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
            raise ValueError(f"schedule {spec!r}: {msg}") from None

    def at(self, server_round: int) -> float:
        """The value for ``server_round`` (1-based)."""
        if server_round < 1:
            raise ValueError(f"rounds start at 1, got {server_round}")
        if self.kind == "constant":
            return self.values[0]
        if self.kind == "list":
            return self.values[min(server_round, len(self.values)) - 1]
        if self.kind == "warmup":
            start, target = self.values
            n = self.rounds[0]
            if server_round > n:
                return target
            return start * (target / start) ** ((server_round - 1) / n)
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
        if self.kind == "warmup":
            return f"warmup:{self.values[0]!r}>{self.values[1]!r}@{self.rounds[0]}"
        return "steps:" + ",".join(f"{v:g}@{r}" for v, r in zip(self.values, self.rounds, strict=True))
