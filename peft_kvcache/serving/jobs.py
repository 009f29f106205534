"""The server's requests between the event loop and the model: each request a `Job`, run one at a time in arrival
order on one worker thread (`JobQueue`), at most ``max_queue`` waiting (429 with ``Retry-After`` beyond); at shutdown
waiting requests are answered 503 at once and the running one is cut after ``drain_timeout`` seconds."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..runtime.reuse import EXACT, Made
from .errors import RequestError
from .openai_api import TextDeltas

logger = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client disconnected before its request was read or answered."""


def refusal(message: str, status: int, code: str, headers: dict | None = None) -> RequestError:
    """A `RequestError` answered with ``headers`` too (``Retry-After``, ``Connection: close``)."""
    err = RequestError(message, status, None, code)
    err.headers = headers or {}
    return err


class Job:
    """One request's link between the event loop and the model worker: the worker pushes events
    (``("first", seconds)`` and ``("delta", text)`` for a stream, then one of ``("done", TurnResult)``,
    ``("error", exception)``, ``("cancelled", None)``: it was cancelled before it started), the server's shutdown
    ``("shutdown", None)`` to a job still waiting."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tokenizer, stop: list[str], arrival: float, stream: bool):
        self.loop, self.events, self.arrival = loop, asyncio.Queue(), arrival
        self.cancelled = False  # stop generating at the next token, store nothing (the client left, or shutdown)
        self.shutdown = False  # cancelled by the server's shutdown (answered 503)
        self.state = "queued"  # -> "running" -> "done" (set by the worker)
        self.started = arrival  # when the model worker took it
        self.delivered = False  # its result was pushed (what fails after that is the store's, not the request's)
        self.prepared: tuple[Made, int] = (EXACT, 0)  # (how its cache was made, cached tokens), before the 1st token
        self.deltas = TextDeltas(tokenizer, stop, emit=(lambda text: self.push("delta", text)) if stream else None,
                                 on_first=(lambda: self.push("first", time.perf_counter() - arrival)) if stream else None)

    def push(self, kind: str, payload) -> None:
        if kind == "done":
            self.delivered = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed: nobody waits for it any more
            pass

    def cut(self) -> None:
        """Cancel it for the server's shutdown."""
        self.cancelled = self.shutdown = True
        if self.state == "queued":
            self.push("shutdown", None)

    async def next_event(self, gone: asyncio.Future) -> tuple[str, object]:
        """The next event, or ``("gone", None)`` once its client disconnected (the job is then cancelled)."""
        get = asyncio.ensure_future(self.events.get())
        done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        self.cancelled = True
        return "gone", None


class JobQueue:
    """The jobs handed to the model worker and not answered yet; one worker thread runs them in arrival order."""

    def __init__(self, max_queue: int, drain_timeout: float):
        self.max_queue, self.drain_timeout = max_queue, drain_timeout
        self.jobs: set[Job] = set()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peft-kvcache-model")  # FIFO, one at a time
        self.closing = False  # shutting down: new requests are answered 503
        self.service_seconds = 1.0  # a running mean of a request's time on the model (for Retry-After)

    def waiting(self) -> int:
        """Requests handed to the worker that it has not started."""
        return sum(job.state == "queued" for job in list(self.jobs))

    def admit(self) -> None:
        """Refuse a request that would wait behind more than ``max_queue`` others (429 with ``Retry-After``), or any
        once the server is shutting down (503)."""
        if self.closing:
            raise refusal("the server is shutting down: retry on another one", 503, "server_shutting_down")
        waiting = self.waiting()
        busy = waiting or any(job.state == "running" for job in list(self.jobs))
        if busy and waiting + 1 > self.max_queue:
            retry = max(1, math.ceil(self.service_seconds * (waiting + 1)))
            raise refusal(f"the server is busy: {waiting} requests wait for the model, at most {self.max_queue} may "
                          f"(--max-queue); retry in {retry} s", 429, "rate_limit_exceeded", {"Retry-After": str(retry)})

    def submit(self, job: Job, work: Callable[[Job], None]) -> None:
        """Run ``work(job)`` on the worker (it pushes ``("done", result)`` itself); `RuntimeError` once closed."""
        self.jobs.add(job)
        self.worker.submit(self._run, job, work)

    def _run(self, job: Job, work: Callable[[Job], None]) -> None:
        try:
            job.started = time.perf_counter()
            if job.cancelled:  # its client left, or the server shut down, while it waited
                job.push("cancelled", None)
                return
            job.state = "running"
            work(job)
            self.service_seconds = 0.8 * self.service_seconds + 0.2 * (time.perf_counter() - job.started)
        except BaseException as err:  # noqa: BLE001 - reported to the request, never to the worker
            if job.delivered:
                logger.exception("keeping the caches of a completed request failed (the store holds only whole "
                                 "entries: the next request prefills what is missing)")
            else:
                job.push("error", err)
        finally:
            job.state = "done"

    def begin_shutdown(self) -> None:
        """Refuse new requests, answer the waiting ones 503 now and cut the running one after ``drain_timeout``
        seconds (at its next token; it stores nothing). Called on the event loop when uvicorn starts shutting down."""
        if self.closing:
            return
        self.closing = True
        for job in list(self.jobs):
            if job.state == "queued":
                job.cut()
        if any(job.state != "done" for job in self.jobs):
            logger.warning("shutting down: the running request has %.1f s to finish (--drain-timeout)",
                           self.drain_timeout)

        def cut() -> None:
            for job in list(self.jobs):
                job.cut()

        asyncio.get_running_loop().call_later(max(0.0, self.drain_timeout), cut)

    def close(self) -> None:
        """Cancel what is left and stop the worker."""
        for job in list(self.jobs):
            job.cut()
        self.worker.shutdown(wait=False, cancel_futures=True)


__all__ = ["ClientGone", "Job", "JobQueue", "refusal"]
