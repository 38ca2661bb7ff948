"""What a line of evidence says: its category (the patterns below, first match wins), its stage, the process it
is about, and the thresholds the ranking uses."""

from __future__ import annotations

import re

# CPU or IO starvation refines a timeout or hang: the subject's heartbeat shows it starved meanwhile
CATEGORIES = ("process_death", "oom_device", "oom_host", "disk", "hang", "timeout", "network", "weights_drift",
              "data_mismatch", "exception", "cpu_starvation", "io_starvation", "slow_rollout", "tool_infra", "straggler", "clock_skew")
STARVED_CPU_WAIT = 60.0  # % of wall time a process's threads waited runnable for a CPU (run-queue wait)
STARVED_IO_PRESSURE = 10.0  # % of time some task waited for IO (PSI), with a thread of the subject in disk wait
HARD = {"process_death", "oom_device", "oom_host", "disk", "hang"}
SOFT = {"straggler", "clock_skew"}  # a cause only when nothing else went wrong: any other hypothesis ranks before it

_RULES = [  # first match wins; applied to the message and its traceback's last line
    # a tool's infrastructure (its service, the sandbox) failed in the environment server: not env-0 itself
    ("tool_infra", r"InfraError|\(the infrastructure, not the model's call|tool infrastructure failures"),
    # the stall watchdog's report of a rank that computes while the others wait: slow, not stuck (SOFT)
    ("straggler", r"is a straggler|median rank's compute a token"),
    # the controller read a peer's clock off its reply: that process's stamps are off (SOFT)
    ("clock_skew", r"^clock: \S+ \(pid \d+[^)]*\) is [\d.]+ s (?:ahead of|behind) "),
    ("process_death", r"killed by SIG|\bdied: |vanished|no exit record"),
    ("oom_device", r"CUDA out of memory|OutOfMemoryError|device[- ]\d+: out of memory|DeviceMemoryNotReleased"),
    ("oom_host", r"\bMemoryError|Cannot allocate memory|bad_alloc"),
    ("disk", r"No space left|ENOSPC|Errno 28|Disk quota|Read-only file system|Input/output error|SafetensorError|"
             r"incomplete metadata|not fully covered|IncompleteCheckpoint|never finished"),
    ("hang", r"SyncStall|has been inside|has been in tool|\bstuck\b|lease lapsed|never left"),
    ("weights_drift", r"logprobs differ by|rollout_train_logprob_diff|silently stale weights"),
    ("data_mismatch", r"Mismatch|InvalidTensorShape|CorruptPayload|must match the size|has shape|checksum"),
    ("timeout", r"RpcTimeout|timed out|no reply from|within [\d.]+ ?s\b|TimeoutError|HTTP 504|\"incomplete\""),
    ("network", r"cannot reach|Connect call failed|Connection reset|[Ss]erver ?[Dd]isconnected|Connection refused|"
                r"Connection closed by peer|ClientConnector|gaierror|Name or service not known|name resolution|"
                r"RpcConnectionError|Broken pipe|ECONNRESET|ConnectionError|[Uu]nreachable|does not answer over the network"),
]
LOG_LINE = re.compile(  # one line of logs/<role>-<rank>.log
    r"^(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}) (?P<proc>[a-z]+-\d+) (?P<level>[A-Z]+) "
    r"(?P<logger>[\w.]+): (?P<msg>.*)$")
_PROC = re.compile(r"\b(train|rollout|reward|env|scheduler|metaserver|controller)-(\d+)\b")
_FAILURE_WARNING = re.compile(r"failed|is a straggler|, a straggler;|^clock: |timed out|not delivered|\bdied\b|lapsed|cannot reach|unreachable|[Ee]rror|^retrying |: migrating |falling back to disk|"
                              r"logprobs differ by|silently stale weights")
_NOT_EVIDENCE = re.compile(r"^first failure of this run|^diagnosis failed|^fault \S+ never fired|^fault audit:|^stopping job|still running|^removed shared-memory|"
                           r"^interrupted ")
_EXC_LINE = re.compile(r"^(?:[\w.]+\.)?(?P<cls>[A-Z]\w*(?:Error|Exception|Mismatch|Timeout|Stall|Payload|Released|"
                       r"Shape|Exit|Interrupt))\b:? ?(?P<msg>.*)$")
_STAGES = ("weights_update", "events", "rollout", "reward", "reference", "train", "latest_recover_save",
           "periodic_recover_save", "evaluate", "sft", "startup", "resume", "cleanup")
_ROUTE_STAGE = [("/generate", "rollout"), ("/update_weights", "weights_update"), ("/upload_weights", "weights_update"),
                ("/broadcast_weights", "weights_update"), ("_weights_update_group", "weights_update"),
                ("/weights", "weights_update"), ("/compute_logprobs", "reference"), ("/train_step", "train"),
                ("/save", "latest_recover_save"), ("/load", "resume"), ("/events", "events"),
                ("_memory_occupation", "events"), ("/jobs", "cleanup"), ("/evaluate", "evaluate"),
                ("/score", "reward"), ("/sft_", "sft")]
CLOCK_LINE = re.compile(r"^clock: (\S+) \(pid (\d+)[^)]*\) is ([\d.]+) s (ahead of|behind) ")
_STEP = re.compile(r"\b(?:at (?:its )?)?step (\d+)")
_WITHIN = re.compile(r"within ([\d.]+) ?s\b")
PARENT = {"rollout": "scheduler-0", "reward": "scheduler-0", "env": "scheduler-0", "scheduler": "train-0"}  # a job dies with the scheduler, the scheduler with rank 0
_BUSY_MIN_S = 3.0
_STALE_ROW_S = 1.6  # a heartbeat row older than this (1 Hz sampler) no longer says what a process is doing  # a request or collective entered this long before the failure and never left
_NOTICE_LAG_S = 1.0  # how much later than a report a hard cause may be noticed and still be the cause


def categorize(text: str) -> str:
    for name, pattern in _RULES:
        if re.search(pattern, text):
            return name
    return "exception"


def stage_of_route(path: str) -> str:
    for prefix, stage in _ROUTE_STAGE:
        if prefix in path:
            return stage
    return ""


def _stage_in(text: str) -> str:
    m = re.search(r"stage ([a-z_]+)", text)
    if m:
        return m.group(1)
    for m in re.finditer(r"(?:POST|GET|DELETE) (/\S+)|https?://[^/\s]+(/[\w/]+)", text):
        if stage_of_route(m.group(1) or m.group(2)):
            return stage_of_route(m.group(1) or m.group(2))
    text = re.sub(r"\brole [a-z_]+", "", text)  # "job rollout-1 (role rollout, …)" names a role, not a stage
    for stage in _STAGES:
        if re.search(rf"\b{stage}\b(?!-\d)", text):
            return stage
    return ""


_UNRESOLVED = re.compile(r"gaierror|Name or service not known|name resolution|nodename nor servname|No address associated")


def _subject(reporter: str, msg: str) -> tuple[str, bool]:
    """The process a message is about, and whether it is the reporter's own (local) failure."""
    body = re.sub(rf"^{re.escape(reporter)}: ", "", msg)  # a handler's "train-1: POST /x failed" names itself
    m = re.search(r"'have': \[([^\]]*)\], 'expected': (\d+)|\"have\": \[([^\]]*)\], \"expected\": (\d+)", body)
    if m:  # the MetaServer's 504: a rank's shards never arrived
        have = set(re.findall(r"rank(\d+)", m.group(1) or m.group(3) or ""))
        missing = [r for r in range(int(m.group(2) or m.group(4))) if str(r) not in have]
        if missing:
            return f"train-{missing[0]}", False
    m = re.search(r"(train-\d+)(?:, train-\d+)*'s upload had not ended", body)
    if m:  # the weights fallback: the MetaServer waited for this rank's shard
        return m.group(1), False
    if _UNRESOLVED.search(body):  # the name failed to resolve where the call was made: the caller's resolver
        m = re.search(r"\bin ([a-z]+-\d+) \(pid|^([a-z]+-\d+): ", body)  # a remote error says where it was raised
        return (m.group(1) or m.group(2), False) if m and (m.group(1) or m.group(2)) != reporter else (reporter, True)
    m = re.search(r"while ([a-z]+-\d+) is in |([a-z]+-\d+) is missing from |(env-\d+) has been in ", body)
    if m:  # the stall watchdog names the one that is elsewhere (or the environment that holds the others)
        return m.group(1) or m.group(2) or m.group(3), False
    if re.search(r"\bagent \S+ (?:failed episode|ran episode|returned|ended episode|has made no call)", body):
        return reporter, True  # the user's agent (agent.path) runs in the controller's process; its last call's server
    for m in _PROC.finditer(body):  # is named beside it, not to blame
        name = m.group(0)
        if name != reporter and not (reporter == "controller-0" and name == "train-0" and "held by" in body):
            return name, False
    return reporter, True
