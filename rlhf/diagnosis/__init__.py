"""Name the root cause of a failed run from what it left behind, never from its fault markers.

    from rlhf.diagnosis import diagnose
    d = diagnose("runs/scenario2")       # d.verdict, d.root, d.chain, d.masked, d.runner_up, d.confidence
    print(d.render())                    # `rlhf diagnose RUN_DIR` prints this and writes diagnosis.json

Evidence read (a real incident has these, and nothing else):

  logs/*.log      ERROR lines, and WARNING lines that report a failure (the fault injector's own
                  lines, logger rlhf.faults, are the answer key and are skipped, as are its end-of-run
                  "never fired" reports)
  exits.jsonl     who started, who ended and how: an exit status with its signal (the scheduler for its
                  jobs, the controller for the scheduler, each rank for itself); a process that started
                  and has no end died where nothing could record it (SIGKILL, the kernel's OOM killer)
  metrics/*.csv   each process's heartbeat: the request or collective it was in, and since when; the
                  last row a process wrote (when it was last alive)
  traces/*.jsonl  server spans: did a request reach its peer, in which stage, at which step

The analysis, in short. Every piece of evidence has a reporter (the process that wrote it) and a
subject (the process it is about: itself for a local cause such as an OOM, the peer it names for a
report such as "HTTP 500 from train-1", "cannot reach rollout-1", "held by train-0"). Evidence about
one subject forms a hypothesis whose onset is its earliest evidence (a timeout's onset is its
deadline minus its wait; a busy process's, when it entered the request it never left). The root
cause is the earliest hypothesis: causes come before their consequences. A hard local cause (a
death, an OOM, a full disk, a hang) noticed up to a second after a softer report still wins, since
the notice lags the event (a death is seen by its parent's next poll, after the peers' disconnects).
A timeout whose request never reached its peer (no server span there, no heartbeat in it) is the
sender's side. Errors after the run had failed (cleanup) are masked: listed, ranked below.

What is where:

    rules.py      a message's category (the patterns), stage and subject; the ranking's thresholds
    logs.py       evidence from logs/*.log (and unfinished background checkpoint writes)
    processes.py  evidence from exits.jsonl and metrics/*.csv: deaths, requests never left, memory held
    clocks.py     a process whose clock is off (the controller's `clock:` line): its stamps on the controller's clock
    spans.py      evidence from traces: failures in transit, requests that never arrived, the stage at a time
    rank.py       diagnose(): hypotheses per process, the root cause, chain, masked errors, runner-up
    report.py     Evidence, Hypothesis, Diagnosis: the headline, the text and diagnosis.json
    cli.py        `rlhf diagnose RUN_DIR`
"""

from rlhf.diagnosis.cli import diagnose_main, write
from rlhf.diagnosis.rank import diagnose
from rlhf.diagnosis.report import Diagnosis, Evidence, Hypothesis, stamp
from rlhf.diagnosis.rules import CATEGORIES, LOG_LINE, categorize, stage_of_route
from rlhf.diagnosis.spans import _spans

__all__ = ["CATEGORIES", "LOG_LINE", "Diagnosis", "Evidence", "Hypothesis", "_spans", "categorize", "diagnose",
           "diagnose_main", "stage_of_route", "stamp", "write"]
