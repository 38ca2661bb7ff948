"""Errors are data: who (role, rank, host, pid), where (stage, step), what (class, message, traceback)."""

from __future__ import annotations

import os
import socket
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ErrorInfo:
    error_class: str
    message: str
    role: str
    rank: int
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    stage: str = ""
    step: int = -1
    traceback: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException, role: str, rank: int, stage: str = "", step: int = -1) -> "ErrorInfo":
        return cls(
            error_class=type(exc).__name__,
            message=str(exc),
            role=role,
            rank=rank,
            stage=stage,
            step=step,
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_reply(cls, error: Any) -> "ErrorInfo | None":
        """Our typed error body's fields (other services' error bodies, sglang's {"message": ...}, give None)."""
        names = set(cls.__dataclass_fields__)
        if not isinstance(error, dict) or not {"error_class", "message", "role", "rank"} <= set(error):
            return None
        return cls(**{k: v for k, v in error.items() if k in names})

    def where(self) -> str:
        return f"{self.role}-{self.rank} (pid {self.pid} on {self.host}), stage {self.stage or '?'}, step {self.step}"


class BadRequest(ValueError):
    """A request the service cannot serve as sent (HTTP 400): the message names the field and the valid choices."""

    http_status = 400


class RemoteError(RuntimeError):
    """An error raised in another process, with its typed fields."""

    def __init__(self, info: ErrorInfo, url: str = "") -> None:
        self.info, self.url = info, url
        super().__init__(f"{info.error_class} in {info.where()}: {info.message}")


class HTTPStatusError(RuntimeError):
    """A non-2xx reply without a typed body (faithful mode's bare 500s, proxies, auth)."""

    def __init__(self, status: int, text: str, url: str, peer: str = "") -> None:
        self.status, self.text, self.url, self.peer = status, text, url, peer
        body = " ".join(text.split())[:200]
        super().__init__(f"HTTP {status} from {_who(url, peer)}: {body}")


class Overloaded(HTTPStatusError):
    """A service over its queue limit: HTTP 503 with Retry-After. Nothing of the request ran, so any request may be
    sent again after retry_after_s (raised by the service's handler, and by the client that gets the reply)."""

    http_status = 503
    expected = True  # load, not a failure of the service: a warning, no traceback

    def __init__(self, message: str, retry_after_s: float, url: str = "", peer: str = "") -> None:
        super().__init__(503, message, url, peer)
        self.retry_after_s = retry_after_s
        if not url:  # raised where it happened: the message alone
            self.args = (message,)


def _who(url: str, peer: str) -> str:
    return f"{peer} ({url})" if peer else url


class RpcTimeout(TimeoutError):
    def __init__(self, url: str, timeout_s: float, peer: str = "") -> None:
        self.url, self.timeout_s, self.peer = url, timeout_s, peer
        super().__init__(f"no reply from {_who(url, peer)} within {timeout_s:g} s")


class NoProgress(RpcTimeout):
    """A long call judged by its progress (the SFT warm start): no rank's heartbeat moved (its step, its CPU time)
    for timeout_s."""

    def __init__(self, url: str, timeout_s: float, peer: str = "", last: str = "") -> None:
        super().__init__(url, timeout_s, peer)
        self.args = (f"no progress from {_who(url, peer)} within {timeout_s:g} s (its heartbeat unchanged: {last})",)


class RpcConnectionError(ConnectionError):
    def __init__(self, url: str, cause: BaseException, peer: str = "") -> None:
        self.url, self.cause, self.peer = url, cause, peer
        super().__init__(f"cannot reach {_who(url, peer)}: {type(cause).__name__}: {cause}")


class CheckpointWriteStalled(OSError):
    """A rank's checkpoint write made no progress (its writer thread neither used CPU nor waited on the disk) for
    checkpoint.write_stall_s: the rank answers with this instead of waiting for it (resilience.abandon_stuck_saves)."""


class SyncStall(RuntimeError):
    """Ranks are in different places and one waits in a collective (or a call) the others will never finish."""


class PreflightStraggler(RuntimeError):
    """The pre-flight check found a rank much slower than the others and preflight.exclude refuses to start."""
