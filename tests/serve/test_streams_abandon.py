"""``streams.abandon``: a stream's pending read that nobody will take leaves no "exception was never
retrieved" behind, whether it is still running (cancelled) or already ended with an error, as a
cancelled engine call over Ray Serve's gRPC transport does (``RequestCancelledError``)."""

import asyncio
import gc

import pytest

from lserve.serve.streams import abandon


class _Cancelled(Exception):
    """Stands in for ray.serve.exceptions.RequestCancelledError (a plain exception)."""


@pytest.mark.parametrize("ended_first", [True, False])
def test_an_abandoned_read_logs_nothing(ended_first):
    reported = []

    async def read():
        await asyncio.sleep(0 if ended_first else 10)
        raise _Cancelled("request was cancelled")

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx))
        pending = asyncio.ensure_future(read())
        await asyncio.sleep(0.01)
        assert pending.done() is ended_first
        abandon(pending)
        await asyncio.sleep(0.01)  # the done callback runs
        assert pending.done()
        del pending
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    assert reported == []
    abandon(None)  # nothing was read: nothing to do
