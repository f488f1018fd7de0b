"""Responses in flight that a shutdown cuts short once its grace period is nearly over.

A cut response still ends as a response: a stream with an error event and `data: [DONE]`, a
whole answer with a 503, so that a client tells a server going away from a finished answer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from service.errors import APIError


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry the request",
                    code="server_shutting_down", retry_after=1)  # fmt: skip


class Drain:
    """What to call to cut each response in flight (cancel the task that runs it)."""

    def __init__(self) -> None:
        self._cuts: set[Callable[[], None]] = set()
        self.cutting = False

    @contextlib.contextmanager
    def cuttable(self, cut: Callable[[], None]) -> Iterator[None]:
        """`cut` is called if a shutdown cuts responses while this block runs."""
        self._cuts.add(cut)
        try:
            yield
        finally:
            self._cuts.discard(cut)

    def cut_all(self) -> None:
        self.cutting = True
        for cut in list(self._cuts):
            cut()
