"""Services: the processes (and in-process servers) of a run, each behind HTTP.

    boot.py            the one start-up of a service process: its flags, death with its parent, the token, its log
                       and start record, one OpenMP pool, the config, heap bound, telemetry, faults; the ready file
    metaserver.py      MetaServer: the weights relay between train ranks and rollout servers (in the controller)
    scheduler.py       Scheduler: starts and stops jobs (rollout servers, the reward server) on its node
    rollout_server/    RolloutServer: the native engine behind sglang's HTTP API
    sglang_launch.py   `python -m rlhf.services.sglang_launch`: our engine started as sglang.launch_server is
    reward_server.py   RewardServer: a reward model's /score
    train_worker/      TrainWorker: one per torchrun rank, the train engine behind RPC
    colocation.py      the device hand-over between a colocated train rank and rollout server
"""
