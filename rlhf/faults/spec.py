"""A fault as data (FaultSpec: name, kind, point, target, when, duration, params), and which peers and ranks a
fault can meet in a world of a given size (`peer_problem`, `check_world`). Parsing and the files: parse.py."""

from __future__ import annotations

import difflib
import fnmatch
import os
from dataclasses import dataclass, field
from typing import Any

from rlhf.faults.points import POINT_PEERS, ROUTES

ROLES = ("controller", "train", "rollout", "metaserver", "scheduler", "reward", "env")




class FaultSpecError(ValueError):
    """A bad fault spec: one message with file, line, field and the valid choices (every problem of the file, in file
    order). `train_ranks_needed`: the train ranks its faults target (a world-size hint), 0 when unknown."""

    def __init__(self, message: str, train_ranks_needed: int = 0) -> None:
        super().__init__(message)
        self.train_ranks_needed = train_ranks_needed


@dataclass
class Target:
    role: str = ""
    ranks: tuple[int, ...] = ()
    peer: str = ""
    host: str = ""  # a host made by rlhf.hosts (RLHF_HOST_NAME in the process's environment)

    def matches(self, role: str, rank: int) -> bool:
        return ((not self.role or self.role == role) and (not self.ranks or rank in self.ranks)
                and (not self.host or os.environ.get("RLHF_HOST_NAME") == self.host))

    def describe(self) -> str:
        who = self.role or "any role"
        if self.ranks:
            who += f" rank {','.join(map(str, self.ranks))}"
        return who + (f" on host {self.host}" if self.host else "") + (f" → {self.peer}" if self.peer else "")


@dataclass
class When:
    steps: tuple[int, ...] = ()
    after_s: float = 0.0
    probability: float = 1.0
    seed: int = 0
    max_hits: int = 0  # 0 = unlimited


@dataclass
class FaultSpec:
    name: str
    kind: str
    point: str
    points: tuple[str, ...]  # the registered points the glob matches
    target: Target = field(default_factory=Target)
    when: When = field(default_factory=When)
    duration_s: float = 0.0  # 0 = until the run ends (background kinds) / kind default
    params: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # file:line

    def to_dict(self) -> dict[str, Any]:
        """Plain data for config.yaml (re-validated by every process that arms it)."""
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "point": self.point,
                               "target": {k: v for k, v in (("role", self.target.role), ("ranks", list(self.target.ranks)),
                                                            ("peer", self.target.peer), ("host", self.target.host))
                                          if v},
                               "when": {k: v for k, v in (("steps", list(self.when.steps)), ("after_s", self.when.after_s),
                                                          ("max_hits", self.when.max_hits)) if v},
                               "params": dict(self.params)}
        if self.when.probability < 1.0:
            out["when"].update(probability=self.when.probability, seed=self.when.seed)
        if self.duration_s:
            out["duration_s"] = self.duration_s
        return out


def _hint(value: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(str(value), choices, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def peer_matches(pattern: str, peer: str) -> bool:
    """A fault's peer pattern against a concrete peer: equal, a prefix up to '-' (train → train-1), or a glob."""
    return not pattern or peer == pattern or peer.startswith(pattern + "-") or fnmatch.fnmatchcase(peer, pattern)


def _candidates(point: str, role: str, train_ranks: int, rollout_servers: int) -> list[str]:
    """The concrete peers `point` can see in a world of this size."""
    if point == "rpc.server.handle":
        roles = [role] if role in ROUTES else list(ROUTES)
        samples = {"{version}": "1", "{shard}": "rank0", "{name}": "rollout-0"}
        out = []
        for r in roles:
            for route in ROUTES[r]:
                for k, v in samples.items():
                    route = route.replace(k, v)
                out.append(route)
        return out
    out = []
    for pattern in POINT_PEERS.get(point, ()):
        if "{r}" not in pattern:
            out.append(pattern)
            continue
        n = rollout_servers if pattern.startswith("rollout") else train_ranks
        out += [pattern.replace("{r}", str(r)) for r in range(n)]
    return out


def peer_problem(peer: str, points: tuple[str, ...], role: str = "", train_ranks: int = 64,
                 rollout_servers: int = 64) -> str | None:
    """Why `peer` can never match at `points` (with the valid choices), or None."""
    if not peer or not points:
        return None
    candidates = [c for p in points for c in _candidates(p, role, train_ranks, rollout_servers)]
    if any(peer_matches(peer, c) for c in candidates):
        return None
    if not candidates:
        return f"{', '.join(points)} has no peer; remove target.peer"
    # routes as the server sees them; other peers as patterns ({r}: any rank), not one line per rank
    valid = sorted({c for c in candidates if c.startswith("/")} | {c for p in points for c in POINT_PEERS.get(p, ())})
    hint = _hint(peer, candidates) or _hint("/" + peer, candidates)
    return f"{peer!r} is never a peer at {', '.join(points)}{hint}, so this fault could never fire; peers: {', '.join(valid)}"


def world_problems(name: str, target: Target, points: tuple[str, ...], train_ranks: int,
                   rollout_servers: int) -> list[str]:
    """Why a fault (its target at its points) could never fire in a world of this size, each with the valid choices."""
    problems = []
    sizes = {"train": train_ranks, "rollout": rollout_servers, "controller": 1, "metaserver": 1, "scheduler": 1,
             "reward": 1, "env": 1}
    n = sizes.get(target.role, max(train_ranks, rollout_servers))
    outside = [r for r in target.ranks if r >= n]
    if outside:
        who = target.role or "any role"
        noun = {"train": "train rank", "rollout": "rollout server"}.get(who, f"{who} rank")
        problems.append(f"fault {name!r} targets {who} rank {outside[0]}, but this run has "
                        f"{n} {noun}{'s' * (n != 1)} (valid: 0..{n - 1}), so it could never fire")
    problem = peer_problem(target.peer, points, target.role, train_ranks, rollout_servers)
    if problem:
        problems.append(f"fault {name!r}: {problem} (with {train_ranks} train ranks and "
                        f"{rollout_servers} rollout servers)")
    return problems


def check_world(specs: list[FaultSpec], train_ranks: int, rollout_servers: int) -> list[str]:
    """Problems of faults that target ranks or peers this run does not have (every one, with the run's world)."""
    return [f"{spec.source}: {problem}" for spec in specs
            for problem in world_problems(spec.name, spec.target, spec.points, train_ranks, rollout_servers)]
