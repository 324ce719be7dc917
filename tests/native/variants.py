"""The instruction-set variants a kernel offers, for tests that run each one."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def available(switch: Callable[..., str], names: Sequence[str]) -> list[str]:
    """Those of ``names`` this CPU can run, by a kernel's switch (``switch()`` names the variant in
    use, ``switch(name)`` selects one or raises ValueError); the variant in use is restored."""
    current = switch()
    found = []
    for name in names:
        try:
            switch(name)
            found.append(name)
        except ValueError:
            pass
    switch(current)
    return found
