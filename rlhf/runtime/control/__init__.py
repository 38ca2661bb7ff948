"""What the controller delegates, one module per job; `controller.py` keeps only the step.

    lifecycle.py       RunLifecycle: start, step loop, first-failure ledger, cleanup, summary
                       (shared by the GRPO and SFT controllers)
    saves.py           CheckpointSaves: latest/periodic saves under the policy (atomic, skipped, fatal)
    reporting.py       FailureReports: the live diagnosis (the console's last line), faults that never fired
    watchdog.py        StallWatchdog: a rank inside one collective or call while the others wait, in seconds
    workers.py         WorkerGroup: one call fanned out to every train rank; their metrics merged
    services.py        RolloutServices: MetaServer, scheduler process, rollout server jobs (RL only)
    weights_sync.py    WeightSync: weights_update (meta or disk) and its verification
    rollout_fanout.py  RolloutFanout: prompts → rollout servers by whole groups; greedy eval
    events.py          ColocationEvents: rollout_start / rollout_end to each colocated pair
"""
