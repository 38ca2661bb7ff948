"""A service's worker thread that a handler can park and that keeps serving while parked.

The rollout server runs every engine call and every weights load on one thread (the engine's). sglang's
/pause_generation mode in_place holds a running call where it is, with its KV cache, while the weights change
under it: the call's own thread must stop at a decode step and still run the weights update that the next
request brings. concurrent.futures.ThreadPoolExecutor cannot run work on a thread that is inside a work item, so
this is a one-thread executor with one queue that both its loop and `park` read.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable

_STOP, _WAKE = object(), object()


class WorkerThread(concurrent.futures.Executor):
    """One thread that runs submitted calls in order; `park(until)` (on that thread, inside a call) runs the calls
    submitted meanwhile until `until()` is true, then returns to the call that parked."""

    def __init__(self, name: str, initializer: Callable[..., Any] | None = None, initargs: tuple = ()) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._shutdown = False
        self.parked = False  # a call on the thread is parked (its caller's pause holds it)
        self._thread = threading.Thread(target=self._loop, args=(initializer, initargs), name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        if self._shutdown:
            raise RuntimeError("cannot schedule new calls after shutdown")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def park(self, until: Callable[[], bool], poll_s: float = 0.05) -> None:
        """On the worker thread: run what is submitted until `until()` holds (checked after each call, on `wake`,
        and every poll_s)."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError("WorkerThread.park runs on the worker thread only")
        self.parked = True
        try:
            while not until():
                try:
                    item = self._queue.get(timeout=poll_s)
                except queue.Empty:
                    continue
                if item is _STOP:
                    self._queue.put(_STOP)  # the loop ends once the parked call returns
                    return
                self._run(item)
        finally:
            self.parked = False

    def wake(self) -> None:
        """Have a parked thread check its condition now."""
        self._queue.put(_WAKE)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shutdown = True
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, tuple):
                    item[0].cancel()
        self._queue.put(_STOP)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _loop(self, initializer: Callable[..., Any] | None, initargs: tuple) -> None:
        if initializer is not None:
            initializer(*initargs)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            self._run(item)

    @staticmethod
    def _run(item: Any) -> None:
        if item is _WAKE:
            return
        future, fn, args, kwargs = item
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller, as ThreadPoolExecutor does
            future.set_exception(exc)
        else:
            future.set_result(result)
