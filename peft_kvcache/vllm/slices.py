"""Work the connector's worker runs inside the engine's steps, a slice at a time, so that a switch never holds the
streams that are decoding: on a CPU the engine's forward and a mapping share the same cores, and a mapping run beside
the forward (another thread) slows every stream's step by as much as it takes.

Each step, after the forward, `StepSlicer.advance` runs the queued jobs' slices in order until they have taken
``share`` of the engine's time since the previous step (``share / (1 - share)`` of the time the engine spent
meanwhile), at least one slice: a decoding stream's step takes at most about ``1 / (1 - share)`` of its time without
the connector, while a mapping still finishes within a few steps (one slice is one target layer). A step that
computed no token (every request waits for a load) holds no stream: the queued slices then run until the first job a
request waits for (a load) has ended, so that request computes in the next step while the loads behind it continue
within the steps (switches arriving together are served one after another, not all after the last mapping).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

DEFAULT_SHARE = 0.2  # a stream's step at most ~1.25x of its time without the connector
# seconds: a longer gap between two calls (a long prefill, or the engine idle) counts as this long, so that a load still
# moves during long prefill steps (one slice a step would take a mapping tens of them) and never holds a step for long
LONGEST_STEP = 1.0


class StepSlicer:
    """Jobs (generators that yield between slices) run within a share of the engine's time, in the order added.

    Example:
        >>> done = []
        >>> def job(name, slices):
        ...     for _ in range(slices):
        ...         yield
        ...     done.append(name)
        >>> slicer = StepSlicer(share=0.2)
        >>> slicer.add(job("a", 2)); slicer.add(job("b", 1))
        >>> slicer.advance(), done    # the first step: no engine time measured yet, one slice
        (1, [])
        >>> while not slicer.idle:
        ...     _ = slicer.advance()
        >>> done
        ['a', 'b']
    """

    def __init__(self, share: float = DEFAULT_SHARE, clock: Callable[[], float] = time.perf_counter):
        if not 0 < share < 1:
            raise ValueError(f"share must be strictly between 0 and 1, got {share!r}")
        self.share, self.clock = share, clock
        self._jobs: deque[tuple[Iterator[None], bool]] = deque()  # each job, and whether a request waits for it
        self._last_end: float | None = None

    @property
    def idle(self) -> bool:
        return not self._jobs

    def add(self, job: Iterator[None], waited_on: bool = False) -> None:
        """Queue a job: a generator whose every ``yield`` ends a slice (its side effects done by its end);
        ``waited_on``: a request waits for it to end (a load), so a step that computed no token runs up to its end."""
        self._jobs.append((job, waited_on))

    def advance(self, forward: bool = True) -> int:
        """Run slices for this step (see the module); ``forward=False``: the step computed no token (every request
        waits for a load, nothing is decoding), so slices run until a job a request waits for has ended (or none is
        left). Returns how many ran."""
        start = self.clock()
        engine = 0.0 if self._last_end is None else start - self._last_end
        budget = min(engine, LONGEST_STEP) * self.share / (1 - self.share)
        slices, released = 0, False
        while self._jobs and (slices == 0 or (self.clock() - start < budget if forward else not released)):
            job, waited_on = self._jobs[0]
            try:
                next(job)
                slices += 1
            except StopIteration:
                self._jobs.popleft()
                released |= waited_on
        self._last_end = self.clock()
        return slices


__all__ = ["DEFAULT_SHARE", "StepSlicer"]
