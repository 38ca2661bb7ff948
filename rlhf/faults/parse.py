"""The fault spec: YAML parsed once and validated fully before a run starts (docs/faults.md).

    faults:
      - name: slow-upload-from-rank-1          # free text; shows in traces and markers
        kind: network_delay                    # `rlhf faults list` shows every kind
        point: weights_update.upload           # a point name or a glob (rpc.*)
        target: {role: train, rank: 1}         # role, rank or ranks, peer, host (a host of rlhf.hosts)
        when: {step: 3}                        # step | steps | after_s | probability (+ seed) | max_hits
        duration_s: 60                         # how long a background effect lasts (default: to the run's end)
        params: {delay_ms: 1000, jitter_ms: 500}

Every error names the file, the line, the field and the valid choices, e.g.

    scenario.yaml:7: faults[0].kind: 'netwrk_delay' is not a fault kind (did you mean 'network_delay'?);
    kinds: clock_skew, cpu_contention, ...
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from typing import Any, Iterator

import yaml

from rlhf.faults.kinds import KINDS, REQUIRED
from rlhf.faults.points import POINT_ROLES, POINTS
from rlhf.faults.spec import ROLES, FaultSpec, FaultSpecError, Target, When, _hint, peer_problem, world_problems

TOP_KEYS = ("name", "kind", "point", "target", "when", "duration_s", "params")
TARGET_KEYS = ("role", "rank", "ranks", "peer", "host")
WHEN_KEYS = ("step", "steps", "after_s", "probability", "seed", "max_hits")


class _Bad(Exception):
    """One problem found (already recorded); the check of that field stops."""


class _Checker:
    """Collects every problem of a file; `field()` lets the checks of independent fields go on after one fails."""

    def __init__(self, source: str, world: tuple[int, int] | None = None) -> None:
        """world: (train ranks, rollout servers) to check targets against, in the same pass as the schema."""
        self.source, self.world = source, world
        self.errors: list[tuple[int, int, str]] = []  # (line, order found, message): reported in file order
        self.train_ranks_needed = 0

    def note(self, node: Any, problem: str) -> None:
        """Record a problem at node's line; the checks go on."""
        line = node.start_mark.line + 1 if node is not None and hasattr(node, "start_mark") else 0
        self.errors.append((line, len(self.errors), f"{self.source}{f':{line}' if line else ''}: {problem}"))

    def fail(self, node: Any, where: str, problem: str) -> None:
        self.note(node, f"{where}: {problem}")
        raise _Bad

    @contextlib.contextmanager
    def field(self) -> Iterator[None]:
        try:
            yield
        except _Bad:
            pass

    def raise_all(self) -> None:
        errors = [message for _, _, message in sorted(self.errors)]
        if len(errors) == 1:
            raise FaultSpecError(errors[0], self.train_ranks_needed)
        if errors:
            raise FaultSpecError(f"{len(errors)} problems:\n  " + "\n  ".join(errors), self.train_ranks_needed)


def _mapping(node: Any) -> dict[str, tuple[Any, Any]]:
    """key → (key node, value node) of a YAML mapping node."""
    return {k.value: (k, v) for k, v in node.value}


def _scalar(chk: _Checker, node: Any, where: str, types: tuple[type, ...], what: str) -> Any:
    if not isinstance(node, yaml.ScalarNode):
        chk.fail(node, where, f"expected {what}, got a {'list' if isinstance(node, yaml.SequenceNode) else 'mapping'}")
    value = yaml.safe_load(yaml.serialize(node))
    if isinstance(value, bool) and bool not in types:
        chk.fail(node, where, f"expected {what}, got {value!r}")
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, types):
        chk.fail(node, where, f"expected {what}, got {value!r}")
    return value


def _int_list(chk: _Checker, node: Any, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(node, yaml.SequenceNode):
        chk.fail(node, where, f"expected a list of integer {what}s")
    return tuple(_scalar(chk, v, where, (int,), f"an integer {what}") for v in node.value)


def parse_faults_text(text: str, source: str = "<faults>", world: tuple[int, int] | None = None) -> list[FaultSpec]:
    """Parse and validate a fault file's text. Raises FaultSpecError listing every problem, each with its line, in
    file order. world = (train ranks, rollout servers): also the faults that target ranks or peers it lacks, in the
    same list."""
    chk = _Checker(source, world)
    try:
        specs = _parse(chk, text, source)
    except _Bad:
        specs = []
    chk.raise_all()
    return specs


def _parse(chk: _Checker, text: str, source: str) -> list[FaultSpec]:
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise FaultSpecError(f"{source}{line}: YAML syntax error: {getattr(exc, 'problem', None) or exc}") from None
    if root is None:
        return []
    if isinstance(root, yaml.MappingNode):
        top = _mapping(root)
        unknown = [k for k in top if k not in ("faults", "config")]
        for key in unknown:
            with chk.field():
                chk.fail(top[key][0], key, f"unknown top-level key{_hint(key, ['faults', 'config'])}; "
                         "a fault file has: faults (a list) and, for a scenario, config (run settings)")
        if "faults" not in top:
            return []
        items = top["faults"][1]
    else:
        items = root
    if isinstance(items, yaml.ScalarNode) and items.value in ("", "null", "~"):
        return []
    if not isinstance(items, yaml.SequenceNode):
        chk.fail(items, "faults", "expected a list of faults (each a mapping starting with '- name: ...')")
    specs = []
    names: set[str] = set()
    for i, item in enumerate(items.value):
        with chk.field():
            spec = _parse_item(chk, item, i, names, source)
            if spec is not None:
                specs.append(spec)
    return specs


def _parse_item(chk: _Checker, item: Any, i: int, names: set[str], source: str) -> FaultSpec | None:
    where = f"faults[{i}]"
    if not isinstance(item, yaml.MappingNode):
        chk.fail(item, where, "expected a mapping with name, kind, point, target, when, duration_s, params")
    m = _mapping(item)
    for key, (knode, _) in m.items():
        if key not in TOP_KEYS:
            with chk.field():
                chk.fail(knode, f"{where}.{key}", f"unknown field{_hint(key, list(TOP_KEYS))}; fields: {', '.join(TOP_KEYS)}")
    missing = [r for r in ("kind", "point") if r not in m]
    if missing:
        chk.fail(item, where, f"missing field '{missing[0]}' (required: kind, point)")
    kind = point = None
    matched: tuple[str, ...] = ()
    with chk.field():
        kind = _scalar(chk, m["kind"][1], f"{where}.kind", (str,), "a kind name")
        if kind not in KINDS:
            chk.fail(m["kind"][1], f"{where}.kind", f"{kind!r} is not a fault kind{_hint(kind, sorted(KINDS))}; "
                     f"kinds: {', '.join(sorted(KINDS))}")
    with chk.field():
        point = _scalar(chk, m["point"][1], f"{where}.point", (str,), "a point name or glob")
        matched = tuple(p for p in POINTS if fnmatch.fnmatchcase(p, point))
        if not matched:
            chk.fail(m["point"][1], f"{where}.point", f"{point!r} matches no fault point{_hint(point, list(POINTS))}; "
                     f"points: {', '.join(POINTS)}")
    name = f"{kind}@{point}#{i}"
    with chk.field():
        if "name" in m:
            name = _scalar(chk, m["name"][1], f"{where}.name", (str,), "a string")
        if name in names:
            chk.fail(m["name"][1] if "name" in m else item, f"{where}.name", f"duplicate fault name {name!r}")
        names.add(name)
    target = Target()
    with chk.field():
        if "target" in m:
            target = _parse_target(chk, m["target"][1], f"{where}.target", matched)
            if target.role in ("", "train") and target.ranks:
                chk.train_ranks_needed = max(chk.train_ranks_needed, max(target.ranks) + 1)
            if chk.world is not None and matched:
                for problem in world_problems(name, target, matched, *chk.world):
                    chk.note(m["target"][1], problem)
    when = When()
    with chk.field():
        if "when" in m:
            when = _parse_when(chk, m["when"][1], f"{where}.when")
    duration = 0.0
    with chk.field():
        if "duration_s" in m:
            duration = _scalar(chk, m["duration_s"][1], f"{where}.duration_s", (float,), "seconds (a number)")
            if duration < 0:
                chk.fail(m["duration_s"][1], f"{where}.duration_s", "must be >= 0")
    if kind not in KINDS or not matched:
        return None
    params = _parse_params(chk, m, item, where, kind)
    problem = KINDS[kind].check_spec(point, matched, target, params)
    if problem:
        chk.fail(item, where, problem)
    return FaultSpec(name, kind, point, matched, target, when, duration, params,  # type: ignore[arg-type]
                     source=f"{source}:{item.start_mark.line + 1}")


def _parse_target(chk: _Checker, tnode: Any, where: str, matched: tuple[str, ...]) -> Target:
    if not isinstance(tnode, yaml.MappingNode):
        chk.fail(tnode, where, "expected a mapping like {role: train, rank: 1}")
    target = Target()
    nodes = _mapping(tnode)
    for key, (knode, vnode) in nodes.items():
        w = f"{where}.{key}"
        with chk.field():
            if key not in TARGET_KEYS:
                chk.fail(knode, w, f"unknown field{_hint(key, list(TARGET_KEYS))}; fields: {', '.join(TARGET_KEYS)}")
            if key == "role":
                role = _scalar(chk, vnode, w, (str,), "a role")
                if role not in ROLES:
                    chk.fail(vnode, w, f"{role!r} is not a role{_hint(role, list(ROLES))}; roles: {', '.join(ROLES)}")
                passing = sorted({r for p in matched for r in POINT_ROLES.get(p, ROLES)})
                if matched and role not in passing:
                    chk.fail(vnode, w, f"role {role} never passes {', '.join(matched)}, so this fault could never fire; "
                             f"roles that pass it: {', '.join(passing)}")
                target.role = role
            elif key == "rank":
                target.ranks = (_scalar(chk, vnode, w, (int,), "an integer rank"),)
            elif key == "ranks":
                target.ranks = _int_list(chk, vnode, w, "rank")
            elif key == "host":
                target.host = str(_scalar(chk, vnode, w, (str,), "a host's name like B (rlhf.hosts)"))
            elif key == "peer":
                target.peer = _scalar(chk, vnode, w, (str,), "a peer like metaserver, scheduler, rollout-0")
                problem = peer_problem(target.peer, matched, target.role)
                if problem:
                    chk.fail(vnode, w, problem)
    for r in target.ranks:
        if r < 0:
            chk.fail(nodes.get("rank", nodes.get("ranks", (None, tnode)))[1], where, f"rank {r} is negative")
    return target


def _parse_when(chk: _Checker, wnode: Any, where: str) -> When:
    if not isinstance(wnode, yaml.MappingNode):
        chk.fail(wnode, where, "expected a mapping like {step: 3}")
    when = When()
    for key, (knode, vnode) in _mapping(wnode).items():
        w = f"{where}.{key}"
        with chk.field():
            if key not in WHEN_KEYS:
                chk.fail(knode, w, f"unknown field{_hint(key, list(WHEN_KEYS))}; fields: {', '.join(WHEN_KEYS)}")
            if key == "step":
                when.steps = (_scalar(chk, vnode, w, (int,), "an integer step"),)
            elif key == "steps":
                when.steps = _int_list(chk, vnode, w, "step")
            elif key == "after_s":
                when.after_s = _scalar(chk, vnode, w, (float,), "seconds (a number)")
            elif key == "probability":
                when.probability = _scalar(chk, vnode, w, (float,), "a probability")
                if not 0.0 <= when.probability <= 1.0:
                    chk.fail(vnode, w, f"{when.probability} is outside [0, 1]")
            elif key == "seed":
                when.seed = _scalar(chk, vnode, w, (int,), "an integer seed")
            elif key == "max_hits":
                when.max_hits = _scalar(chk, vnode, w, (int,), "an integer")
                if when.max_hits < 0:
                    chk.fail(vnode, w, "must be >= 0 (0 = unlimited)")
    return when


def _parse_params(chk: _Checker, m: dict[str, tuple[Any, Any]], item: Any, where: str, kind: str) -> dict[str, Any]:
    params: dict[str, Any] = {}
    kind_cls = KINDS[kind]
    pnodes: dict[str, tuple[Any, Any]] = {}
    if "params" in m:
        pnode = m["params"][1]
        if not isinstance(pnode, yaml.MappingNode):
            chk.fail(pnode, f"{where}.params", "expected a mapping")
        pnodes = _mapping(pnode)
    for key, (knode, vnode) in pnodes.items():
        if key not in kind_cls.PARAMS:
            valid = ", ".join(kind_cls.PARAMS) or "none"
            with chk.field():
                chk.fail(knode, f"{where}.params.{key}", f"{kind} has no parameter {key!r}"
                         f"{_hint(key, list(kind_cls.PARAMS))}; its parameters: {valid}")
    for key, (types, default, doc) in kind_cls.PARAMS.items():
        w = f"{where}.params.{key}"
        with chk.field():
            if key in pnodes:
                vnode = pnodes[key][1]
                what = doc.split(";")[0]
                if types == (list,):
                    if not isinstance(vnode, yaml.SequenceNode):
                        chk.fail(vnode, w, f"expected a list ({what})")
                    value = yaml.safe_load(yaml.serialize(vnode))
                else:
                    value = _scalar(chk, vnode, w, types, what)
                problem = kind_cls.check_param(key, value)
                if problem:
                    chk.fail(vnode, w, problem)
                params[key] = value
            elif default is REQUIRED:
                chk.fail(item, f"{where}.params", f"{kind} needs parameter {key!r} ({doc})")
            else:
                params[key] = default
    if len(params) < len(kind_cls.PARAMS):
        raise _Bad  # a parameter was wrong (recorded): check_spec would judge a partial fault
    return params


BUNDLED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "examples", "faults")


def bundled_fault_files() -> dict[str, str]:
    """The scenario files shipped in examples/faults: name -> its first comment line."""
    if not os.path.isdir(BUNDLED_DIR):
        return {}
    out = {}
    for name in sorted(os.listdir(BUNDLED_DIR)):
        if name.endswith(".yaml"):
            with open(os.path.join(BUNDLED_DIR, name), encoding="utf-8") as fh:
                first = fh.readline().strip()
            out[name] = first.lstrip("# ") if first.startswith("#") else ""
    return out


def resolve_fault_file(path: str) -> str:
    """`path` if it exists; a bare name (scenario2, scenario2.yaml) finds the bundled file in examples/faults."""
    if os.path.exists(path) or os.sep in path:
        return path
    for name in (path, path + ".yaml"):
        candidate = os.path.join(BUNDLED_DIR, name)
        if os.path.isfile(candidate):
            return candidate
    bundled = ", ".join(bundled_fault_files()) or "none found"
    raise FaultSpecError(f"{path}: no such file here, and no bundled fault file of that name "
                         f"(bundled in examples/faults: {bundled})")


def load_fault_config(path: str) -> dict[str, Any]:
    """The `config:` section of a scenario file: run settings (resilience, scaled timeouts, steps) it needs.

    Applied over the preset and --config, under the command line's own flags.
    """
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    section = data.get("config") or {} if isinstance(data, dict) else {}
    if not isinstance(section, dict):
        raise FaultSpecError(f"{path}: config: expected a mapping of config sections")
    return section


def load_fault_file(path: str, world: tuple[int, int] | None = None) -> list[FaultSpec]:
    """A fault file, validated (with the world, if given: see parse_faults_text)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise FaultSpecError(f"{path}: cannot read fault file: {exc.strerror}") from None
    return parse_faults_text(text, source=path, world=world)


def parse_fault_dicts(items: list[dict[str, Any]], source: str = "config.yaml") -> list[FaultSpec]:
    """Re-validate the fault list carried in a run's config (each process arms from it)."""
    return parse_faults_text(yaml.safe_dump({"faults": items}, sort_keys=False), source=source)
