"""A simulated world (sim.train_ranks > 0): the real controller, MetaServer, scheduler, stall watchdog, tracing, faults
and `rlhf diagnose` drive train ranks and rollout servers that are this project's own services — the same routes,
fault points, heartbeats, exit records, spans and run token — whose compute is a cost model (EMULATED), many of
them served by one OS process (each its own port).

    cost.py             the cost model: seconds per token, a lognormal jitter; and the simulated collective (a
                        barrier over a c10d TCPStore that the world's launcher hosts)
    train_ranks.py      `python -m rlhf.sim.train_ranks`: sim.ranks_per_process train ranks in one process
    rollout_servers.py  `python -m rlhf.sim.rollout_servers`: sim.servers_per_process rollout servers in one
                        process, each the real RolloutServer over an engine that emulates generation
    (rlhf.control.sim_launch, an entry point beside control/launch: the launcher, the train rank processes, then
    the real Controller in its process)

What is real: every HTTP hop, the weight shards (the embedded model's bytes, one copy a process, relayed through
the MetaServer and checked end to end), checkpoints' files (small: a rank's counters, not a model), spans, logs and
exit records. What is EMULATED: the forward and backward passes, sampling (random tokens), the gradient all-reduce
(a barrier), the optimizer (one parameter nudged a step, so each version's weights differ).
"""

from __future__ import annotations

import argparse

from rlhf.services.boot import service_parser


def host_parser(doc: str | None, what: str) -> argparse.ArgumentParser:
    """The command line of a process that serves several simulated `what` (train ranks, rollout servers)."""
    parser = service_parser(doc, rank=False, config=True)
    parser.add_argument("--first", type=int, required=True, help=f"the first of the {what} this process serves")
    parser.add_argument("--count", type=int, required=True, help=f"how many {what} this process serves")
    return parser
