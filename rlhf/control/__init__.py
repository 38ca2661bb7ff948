"""Control: the single controller and everything it delegates, one module per job.

    controller.py      Controller: the GRPO step, stage by stage (the order, nothing else)
    sft_controller.py  SFTController: the SFT baseline on the same train workers
    launch.py          the trainers' entry: torchrun ranks, the controller on rank 0, the train workers
    lifecycle.py       RunLifecycle: start, step loop, first-failure ledger, cleanup, summary
                       (shared by the GRPO and SFT controllers)
    saves.py           CheckpointSaves: latest/periodic saves under the policy (atomic, skipped, fatal)
    reporting.py       FailureReports: the live diagnosis (the console's last line), faults that never fired
    watchdog.py        StallWatchdog: a rank inside one collective or call while the others wait, in seconds
    workers.py         WorkerGroup: one call fanned out to every train rank; their metrics merged
    fleet.py           RolloutServices: MetaServer, scheduler process, rollout server and reward server jobs,
                       restarts (RL only)
    weights_sync.py    WeightSync: weights_update (meta, disk or distributed) and its verification
    broadcast.py       the distributed weights update: the rollout servers' group, bucket by bucket
    rollout_fanout.py  RolloutFanout: prompts → rollout servers by whole groups; greedy eval
    events.py          ColocationEvents: rollout_start / rollout_end to each colocated pair
"""
