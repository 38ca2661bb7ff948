"""`rlhf trace <run-dir>`: a run's traces in the terminal, or as Jaeger / Perfetto files.

    rlhf trace runs/x                       every trace (startup, evaluations, steps, cleanup) to
                                            depth 1 (the stages); errors and fault events always
                                            shown with the spans that lead to them
    rlhf trace runs/x --step 3              step 3's whole tree (every process)
    rlhf trace runs/x --depth 3             deeper trees for every trace
    rlhf trace runs/x --format jaeger -o run.json     JSON that Jaeger UI's "Upload" accepts
    rlhf trace runs/x --format perfetto -o run.json   Chrome trace JSON (ui.perfetto.dev, chrome://tracing)

Columns: start offset from the trace's root (s), duration (s), span (indented by depth;
`→ peer` on RPC client spans), the process it ran in (service.instance.id), and how many
spans lie below when the tree is cut at --depth. `✗` marks an error (class and message), `⚡` a
fault event.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from typing import Any

from rlhf import exits
from rlhf.tracing.read import SpanRecord, TraceSet, load_spans

ERROR_MARK, FAULT_MARK = "✗", "⚡"


# ---------------------------------------------------------------------------- text


def _label(s: SpanRecord) -> str:
    label = s.name
    if s.kind == "client" and s.attributes.get("rlhf.peer"):
        label += f" → {s.attributes['rlhf.peer']}"
    return label


def _notes(s: SpanRecord) -> list[str]:
    notes = []
    for e in s.events:
        if e["name"] == "exception":
            a = e["attributes"]
            where = ""
            if a.get("rlhf.error.role"):
                where = f" [{a.get('rlhf.error.role')}-{a.get('rlhf.error.rank')}]"
            notes.append(f"{ERROR_MARK} {a.get('rlhf.error.error_class') or a.get('exception.type')}{where}: "
                         f"{str(a.get('rlhf.error.message') or a.get('exception.message', ''))[:160]}")
        elif e["name"].startswith("fault"):
            a = e["attributes"]
            notes.append(f"{FAULT_MARK} {e['name']} {a.get('rlhf.fault.name', '')} ({a.get('rlhf.fault.kind', '')} at "
                         f"{a.get('rlhf.fault.point', '')})")
    if s.error and not any(n.startswith(ERROR_MARK) for n in notes):
        notes.append(f"{ERROR_MARK} {s.status_message or 'error'}")
    return notes


def _interesting(root: SpanRecord) -> set[str]:
    """Span ids on a path from the root to an error or a fault event."""
    keep: set[str] = set()

    def visit(s: SpanRecord, path: list[str]) -> None:
        path = path + [s.span_id]
        if s.error or any(e["name"] == "exception" or e["name"].startswith("fault") for e in s.events):
            keep.update(path)
        for c in s.children:
            visit(c, path)

    visit(root, [])
    return keep


def _title(root: SpanRecord) -> str:
    if root.name == "step":
        return f"step {root.step}"
    return root.name


def render_tree(root: SpanRecord, depth: int | None, out: list[str], width: int = 58) -> None:
    keep = _interesting(root)
    spans = [s for s, _ in root.walk()]
    errors = sum(1 for s in spans if s.error)
    faults = sum(1 for s in spans for e in s.events if e["name"] == "fault.inject")
    status = (f"  {ERROR_MARK} {errors} error span{'s' * (errors != 1)}" if errors else "") + \
             (f"  {FAULT_MARK} {faults} fault{'s' * (faults != 1)}" if faults else "")
    out.append(f"{_title(root)}  {root.duration_s:.3f} s  trace {root.trace_id[:16]}  ({root.service}){status}")

    def below(s: SpanRecord) -> int:
        return sum(1 + below(c) for c in s.children)

    def visit(s: SpanRecord, d: int) -> None:
        for c in s.children:
            if not (depth is None or d < depth or c.span_id in keep):
                continue
            name = "  " * (d + 1) + _label(c)
            deeper = [g for g in c.children if not (depth is None or d + 1 < depth or g.span_id in keep)]
            more = sum(1 + below(g) for g in deeper)
            line = f"  {(c.start_ns - root.start_ns) / 1e9:+8.3f} {c.duration_s:8.3f}  {name:<{width}} {c.service:<13}"
            out.append((line + (f" +{more} below" if more else "")).rstrip())
            for note in _notes(c):
                out.append(" " * 20 + "  " * (d + 2) + note)
            visit(c, d + 1)

    for note in _notes(root):
        out.append(" " * 20 + "  " + note)
    visit(root, 0)


def render_text(ts: TraceSet, step: int | None = None, depth: int | None = 1) -> str:
    roots = ts.trees()
    services = sorted({s.service for s in ts.spans})
    out = [f"{len(roots)} traces, {len(ts.spans)} spans from {len(services)} processes: {', '.join(services)}"]
    if ts.bad_lines:
        out.append(f"({ts.bad_lines} cut-short lines skipped: a process was killed mid-write)")
    if step is not None:
        chosen = [r for r in roots if r.name == "step" and r.step == step]
        if not chosen:
            steps = sorted({r.step for r in roots if r.name == "step" and r.step is not None})
            raise SystemExit(f"rlhf trace: no trace for step {step}; steps traced: "
                             f"{_ranges(steps) if steps else 'none'}")
        roots = chosen
    for r in roots:
        out.append("")
        render_tree(r, depth, out)
    return "\n".join(out)


def process_ends(run_dir: str, ts: TraceSet) -> list[str]:
    """Processes that did not end normally (exits.jsonl), each with the last span it exported.

    A SIGKILLed process never exports what it had open; its last exported span (spans are flushed every
    tracing.export_delay_ms) and its exit status say where it was."""
    out = []
    for life in exits.all_lives(run_dir):
        name, pid = life["process"], life["pid"]
        if life["end"] is not None and not life["signal"] and life["expected"] is not False:
            continue
        if life["end"] is None:
            how = "no exit record: vanished (SIGKILL, the kernel's OOM killer) or still running"
        else:
            how = f"{exits.describe(life['exit_code'])}{' (' + life['reason'] + ')' if life['reason'] else ''}, " \
                  f"seen by {life['by']} at {_clock(life['end'])}"
        mine = [s for s in ts.spans if s.resource.get("process.pid") == pid]
        last = max(mine, key=lambda s: s.end_ns) if mine else None
        span = (f"last exported span: {_label(last)}{f' (step {last.step})' if last.step is not None else ''} ended "
                f"{_clock(last.end_ns / 1e9)}") if last else "no span exported"
        out.append(f"  {name} (pid {pid}): {how}; {span}")
    return ["", "processes that did not end normally:", *out] if out else []


def _clock(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def _ranges(values: list[int]) -> str:
    parts, start, prev = [], None, None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:  # type: ignore[operator]
            prev = v
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = v
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------- jaeger


def _jaeger_tag(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    return {"key": key, "type": "string", "value": value if isinstance(value, str) else json.dumps(value)}


def to_jaeger(ts: TraceSet) -> dict[str, Any]:
    """Jaeger's JSON model (as its query API returns and its UI uploads): data[] of traces."""
    data = []
    for trace_id, spans in ts.by_trace().items():
        processes: dict[str, dict[str, Any]] = {}
        pid_of: dict[str, str] = {}
        for s in spans:
            if s.service not in pid_of:
                pid = f"p{len(pid_of) + 1}"
                pid_of[s.service] = pid
                processes[pid] = {"serviceName": s.service_name,
                                  "tags": [_jaeger_tag(k, v) for k, v in sorted(s.resource.items())
                                           if k != "service.name"]}
        ids = {s.span_id for s in spans}
        out_spans = []
        for s in spans:
            tags = [_jaeger_tag(k, v) for k, v in s.attributes.items()]
            tags.append(_jaeger_tag("span.kind", s.kind))
            if s.error:
                tags += [_jaeger_tag("error", True), _jaeger_tag("otel.status_description", s.status_message)]
            refs = ([{"refType": "CHILD_OF", "traceID": trace_id, "spanID": s.parent_id}]
                    if s.parent_id and s.parent_id in ids else [])
            out_spans.append({
                "traceID": trace_id, "spanID": s.span_id, "flags": 1, "operationName": s.name, "references": refs,
                "startTime": s.start_ns // 1000, "duration": max(0, (s.end_ns - s.start_ns) // 1000), "tags": tags,
                "logs": [{"timestamp": e["time_ns"] // 1000,
                          "fields": [_jaeger_tag("event", e["name"])] + [_jaeger_tag(k, v) for k, v in e["attributes"].items()]}
                         for e in s.events],
                "processID": pid_of[s.service], "warnings": None,
            })
        data.append({"traceID": trace_id, "spans": out_spans, "processes": processes, "warnings": None})
    return {"data": data, "total": 0, "limit": 0, "offset": 0, "errors": None}


# ---------------------------------------------------------------------------- perfetto


def to_perfetto(ts: TraceSet) -> dict[str, Any]:
    """Chrome trace JSON: one process per service instance, lanes (tids) so that spans nest per lane."""
    if not ts.spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(s.start_ns for s in ts.spans)
    events: list[dict[str, Any]] = []
    services = sorted({s.service for s in ts.spans})
    for pid, service in enumerate(services, start=1):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": service}})
        lanes: list[list[SpanRecord]] = []  # per lane, the stack of spans still open
        mine = sorted((s for s in ts.spans if s.service == service), key=lambda s: (s.start_ns, -s.end_ns))
        for s in mine:
            for tid, stack in enumerate(lanes):
                while stack and stack[-1].end_ns <= s.start_ns:
                    stack.pop()
                if not stack or stack[-1].end_ns >= s.end_ns:
                    stack.append(s)
                    break
            else:
                lanes.append([s])
                tid = len(lanes) - 1
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid + 1,
                               "args": {"name": f"lane {tid + 1}"}})
            args = {k: v for k, v in s.attributes.items()}
            if s.error:
                args["error"] = s.status_message
            events.append({"name": _label(s), "cat": s.attributes.get("rlhf.stage") or s.kind, "ph": "X",
                           "ts": (s.start_ns - t0) / 1000, "dur": (s.end_ns - s.start_ns) / 1000, "pid": pid,
                           "tid": tid + 1, "args": args})
            for e in s.events:
                events.append({"name": e["name"], "cat": "event", "ph": "i", "s": "t", "ts": (e["time_ns"] - t0) / 1000,
                               "pid": pid, "tid": tid + 1, "args": e["attributes"]})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# ---------------------------------------------------------------------------- command


def trace_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf trace", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory (with traces/*.jsonl)")
    parser.add_argument("--step", type=int, help="show this step's whole tree")
    parser.add_argument("--depth", type=int, default=None,
                        help="tree depth below each root (default: 1, the stages; with --step: the whole tree)")
    parser.add_argument("--format", choices=["text", "jaeger", "perfetto"], default="text")
    parser.add_argument("-o", "--output", help="file to write (jaeger/perfetto); default stdout")
    args = parser.parse_args(argv)
    try:
        ts = load_spans(args.run_dir)
    except FileNotFoundError as exc:
        print(f"rlhf trace: {exc}", file=sys.stderr)
        return 2
    if args.format == "text":
        depth = args.depth if args.depth is not None else (None if args.step is not None else 1)
        text = "\n".join([render_text(ts, args.step, depth), *process_ends(args.run_dir, ts)])
    else:
        text = json.dumps(to_jaeger(ts) if args.format == "jaeger" else to_perfetto(ts))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text + ("\n" if args.format == "text" else ""))
        print(f"wrote {args.output} ({len(ts.spans)} spans)", file=sys.stderr)
    else:
        print(text)
    return 0
