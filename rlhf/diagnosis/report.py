"""The report: Evidence (one fact, who wrote it, about whom), Hypothesis (a process's evidence, ranked), and
Diagnosis (the root cause, the chain, the masked errors; headline, text and JSON)."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Evidence:
    time: float  # when it was written (a log line's stamp)
    onset: float  # when what it reports began (a timeout: its deadline minus its wait)
    reporter: str  # the process that wrote it
    subject: str  # the process it is about (the reporter for a local cause)
    category: str
    stage: str
    step: int
    message: str
    source: str  # logs/train-1.log:123, exits.jsonl, metrics/train-1.csv:45, span <id>
    kind: str  # error, warning, exit, vanished, busy
    local: bool  # a cause in the subject itself, not a peer's report about it
    pid: int | None = None  # the subject's pid, where the evidence knows it (an exit record)
    step_at_least: bool = False  # step is the last one its heartbeat finished (idle then): a later one may have begun

    def brief(self, t0: float | None = None) -> str:
        at = f"+{self.time - t0:.3f}s" if t0 is not None else _clock(self.time)
        return f"{at} {self.reporter}: {self.message[:200]} [{self.source}]"


@dataclass
class Hypothesis:
    process: str
    pid: int | None
    stage: str
    step: int
    time: float
    category: str
    summary: str
    source: str = ""  # where the deciding evidence is: logs/scheduler-0.log:12, exits.jsonl, metrics/train-1.csv:40
    evidence: list[Evidence] = field(default_factory=list)
    exit: str = ""  # how that process (pid) ended: "killed by SIGKILL", "exit 1", "vanished"; "" while it ran on
    replaced_by: int | None = None  # the pid of a process of the same name started after it (a restart)

    def key(self) -> tuple[str, str, str]:
        return self.process, self.stage, self.category


@dataclass
class Diagnosis:
    run_dir: str
    verdict: str  # failed, finished with errors, no failure, running
    surfaced: Evidence | None = None
    root: Hypothesis | None = None
    runner_up: Hypothesis | None = None
    confidence: float = 0.0
    chain: list[Evidence] = field(default_factory=list)
    masked: list[dict[str, Any]] = field(default_factory=list)
    stalls: list[str] = field(default_factory=list)

    def headline(self) -> str:
        """One line: the root cause (what the run's last console line says)."""
        if self.root is None:
            return f"diagnosis: {self.verdict}; no error in the logs, exit records or heartbeats"
        r = self.root
        where = f"step {r.step}, stage {r.stage}" if r.step >= 0 else f"stage {r.stage}"
        who = [f"pid {r.pid}"] if r.pid else []
        who += [r.exit] if r.exit else []
        pid = f" ({', '.join(who)}{f'; restarted as pid {r.replaced_by}' if r.replaced_by else ''})" if who else ""
        return f"root cause: {r.process}{pid}, {where}: {r.category}: {r.summary}"

    def to_json(self) -> dict[str, Any]:
        def hyp(h: Hypothesis | None) -> dict[str, Any] | None:
            if h is None:
                return None
            d = asdict(h)
            d["evidence"] = [_ev_json(e) for e in h.evidence[:8]]
            return d

        return {"run_dir": self.run_dir, "verdict": self.verdict, "headline": self.headline(),
                "root_cause": hyp(self.root), "runner_up": hyp(self.runner_up), "confidence": self.confidence,
                "surfaced": _ev_json(self.surfaced) if self.surfaced else None,
                "propagation": [_ev_json(e) for e in self.chain], "masked": self.masked, "stalls": self.stalls}

    def render(self) -> str:
        lines = [f"run: {self.run_dir}", f"verdict: {self.verdict}", self.headline()]
        if self.root is None:
            return "\n".join(lines)
        t0 = self.root.time
        lines.append(f"confidence: {self.confidence:.2f}   deciding evidence: {self.root.source}")
        lines.append("evidence:")
        lines += [f"  {e.brief(t0)}" for e in self.root.evidence[:6]]
        if self.chain:
            lines.append("propagation (root cause → where the run surfaced it):")
            lines += [f"  {e.brief(t0)}  ({e.stage or '?'})" for e in self.chain]
        if self.stalls:
            lines.append("stalls:")
            lines += [f"  {s}" for s in self.stalls]
        if self.masked:
            lines.append("masked (later errors ranked below the root cause):")
            lines += [f"  {m['process']}: {m['message'][:160]} — {m['why']}" for m in self.masked[:8]]
            if len(self.masked) > 8:
                lines.append(f"  … {len(self.masked) - 8} more")
        if self.runner_up is not None:
            u = self.runner_up
            lines.append(f"runner-up: {u.process}, stage {u.stage}: {u.category}: {u.summary[:160]}")
        return "\n".join(lines)


def _ev_json(e: Evidence) -> dict[str, Any]:
    return asdict(e)


def _clock(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def stamp(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%f").timestamp()
