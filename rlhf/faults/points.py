"""Every fault point: where the framework asks "is a fault armed here for me?".

A point is one call, `fault_point("train.step")` (or `await afault_point(...)` on an event
loop). Disarmed, that call is one global lookup and a comparison; `benchmarks/overhead.py`
measures it.
"""

POINTS: dict[str, str] = {
    "weights_update.upload": "train rank, before it PUTs its shard to the MetaServer (peer: metaserver)",
    "weights_update.update": "rollout server, before it pulls a version from the MetaServer or loads a directory",
    "weights_update.save_dir": "train rank 0, before it writes the HF directory the rollout servers load (disk mode)",
    "rollout.generate": "rollout server, before a /generate batch runs",
    "reference.compute": "train rank, before reference (or old-policy) logprobs",
    "train.step": "train rank, before the GRPO loss/backward/optimizer step",
    "sft.step": "train rank, before an SFT step (warm start and the SFT baseline)",
    "collective.all_reduce": "train rank, before every all_reduce (gradients and counts)",
    "rpc.client.send": "any process, before an RPC request leaves (peer: the callee, e.g. train-1, metaserver)",
    "rpc.server.handle": "any service, before a request's handler runs (peer: the route path)",
    "metaserver.put": "MetaServer, on a shard upload, before it is stored",
    "metaserver.get": "MetaServer, before a shard or manifest is served",
    "events.notify": "controller, before a colocation event is sent (peer: train-R or rollout-R)",
    "events.handle": "train rank or rollout server, when it handles a colocation event (peer: the event, e.g. rollout_end)",
    "checkpoint.write": "train rank, half-way through writing each checkpoint tensor file (half of it is written)",
    "checkpoint.fsync": "train rank, before each checkpoint file is fsynced",
    "checkpoint.load": "train rank, before a checkpoint is loaded (resume)",
    "scheduler.stop_job": "controller, before it asks the scheduler to stop a job (peer: scheduler)",
    "data.split": "controller, before DistributedBatchMemory splits the batch across ranks",
    "step.begin": "controller, at the start of every step (for faults that should start at a step)",
}
