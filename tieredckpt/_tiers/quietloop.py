"""fsspec's event loop kept from printing aiohttp's tracebacks during an outage."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("tieredckpt.transport")


def quiet_orphaned_body_writers(loop: asyncio.AbstractEventLoop) -> None:
    """Keep aiohttp's orphaned body writers from printing tracebacks on the user's terminal.

    When a connection is reset before a request's headers go out (a dead endpoint, a proxy
    that resets), aiohttp's request fails -- and we retry it, or say why we gave up -- but the
    task it started to write the body fails too, outside its own error handling, and nobody
    awaits it: asyncio then logs "Task exception was never retrieved" with a traceback from
    deep inside aiohttp, several per second of outage. Those go to debug logging; every other
    report goes where it went (the loop's handler, which may be the user's). fsspec's loop is
    shared by every async filesystem in the process; this touches only that one kind of report."""
    previous = loop.get_exception_handler()
    if getattr(previous, "_tieredckpt", False):
        return

    def handler(loop, context) -> None:
        task, exc = context.get("future"), context.get("exception")
        coro = task.get_coro() if isinstance(task, asyncio.Task) else None
        if isinstance(exc, OSError) and getattr(coro, "__qualname__", "") == "ClientRequest.write_bytes":
            log.debug("an abandoned request body failed to send: %r", exc)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)
    handler._tieredckpt = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)
