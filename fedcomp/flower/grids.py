"""A Flower ``Grid`` that hands every call to another grid: the base of the grids that change one
thing about it (:class:`fedcomp.app.fl.MeteredGrid` meters the messages,
:class:`fedcomp.flower.sampling.SeededSampling` lists the nodes in partition order)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

__all__ = ["DelegatingGrid"]


class DelegatingGrid(Grid):
    """``grid`` itself, call for call; a subclass overrides what it changes."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self._grid.send_and_receive(messages, timeout=timeout)

    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def get_nodes(self) -> Iterable[Any]:
        return self._grid.get_nodes()

    def __getattr__(self, name: str) -> Any:  # anything a concrete grid adds
        return getattr(self._grid, name)
