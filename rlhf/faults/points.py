"""Every fault point: where the framework asks "is a fault armed here for me?".

A point is one call, `fault_point("train.step")` (or `await afault_point(...)` on an event
loop). Disarmed, that call is one global lookup and a comparison; `benchmarks/overhead.py`
measures it.
"""

POINTS: dict[str, str] = {
    "weights_update.upload": "train rank, before it PUTs its shard to the MetaServer (peer: metaserver)",
    "weights_update.update": "rollout server, before it pulls a version from the MetaServer or loads a directory",
    "weights_update.save_dir": "train rank 0, before it writes the HF directory the rollout servers load (disk mode)",
    "weights_update.broadcast": "train rank 0 before it broadcasts a bucket of the weights, and a rollout server "
                                "before it receives one (weights.mode distributed; peer: the group's name)",
    "rollout.generate": "rollout server, before a /generate batch runs",
    "reward.compute": "controller, before the step's completions are scored by the reward functions",
    "reward_model.score": "reward server (reward_model.path), before it scores a step's completions",
    "reference.compute": "train rank, before reference (or old-policy) logprobs",
    "train.step": "train rank, before the GRPO loss/backward/optimizer step",
    "sft.step": "train rank, before an SFT step (warm start and the SFT baseline)",
    "collective.all_reduce": "train rank, before every all_reduce (gradients and counts; tensor parallel's sum of a "
                             "row-wise layer's output)",
    "collective.all_gather": "train rank under parallel.layout fsdp, before each all-gather of a layer's parameters "
                             "(before its forward and its backward)",
    "collective.reduce_scatter": "train rank under parallel.layout fsdp, before each reduce-scatter of a layer's "
                                 "gradients",
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
    "rollout.pause": "controller (rollout.mode async), before it asks a rollout server to pause for a weights update "
                     "(peer: rollout-R)",
    "rollout.continue": "controller (rollout.mode async), before it asks a rollout server to continue after a "
                        "weights update (peer: rollout-R)",
    "buffer.put": "controller's rollout producer (rollout.mode async), before a produced batch enters the buffer "
                  "(an error there is raised by the step that takes the batch)",
    "buffer.get": "controller (rollout.mode async), before a step takes its batch from the buffer",
    "step.begin": "controller, at the start of every step (for faults that should start at a step)",
    "env.reset": "environment server env-0 (env.path), before an episode's environment is reset",
    "env.step": "environment server env-0 (env.path), before an environment answers a model turn",
    "tool.call": "environment server env-0 (env.path tool_calls), before a tool runs",
    "sandbox.exec": "environment server env-0 (the python tool, rlhf.envs.sandbox), before the model's code runs",
    "preflight.check": "train rank, in the pre-flight check (--preflight), pinned to its own CPU, before it times its matmul",
}

# Which roles pass each point: a fault whose target.role never passes its point can never fire.
_TRAIN, _ROLLOUT, _CONTROLLER = ("train",), ("rollout",), ("controller",)
POINT_ROLES: dict[str, tuple[str, ...]] = {
    "weights_update.upload": _TRAIN, "weights_update.update": _ROLLOUT, "weights_update.save_dir": _TRAIN,
    "weights_update.broadcast": ("train", "rollout"),
    "rollout.generate": _ROLLOUT, "reference.compute": _TRAIN, "train.step": _TRAIN, "sft.step": _TRAIN,
    "collective.all_reduce": _TRAIN, "collective.all_gather": _TRAIN, "collective.reduce_scatter": _TRAIN,
    "rpc.client.send": ("controller", "train", "rollout"),
    "rpc.server.handle": ("train", "rollout", "metaserver", "scheduler", "reward", "env"), "metaserver.put": ("metaserver",),
    "metaserver.get": ("metaserver",), "events.notify": _CONTROLLER, "events.handle": ("train", "rollout"),
    "checkpoint.write": _TRAIN, "checkpoint.fsync": _TRAIN, "checkpoint.load": _TRAIN,
    "scheduler.stop_job": _CONTROLLER, "data.split": _CONTROLLER, "step.begin": _CONTROLLER,
    "buffer.put": _CONTROLLER, "buffer.get": _CONTROLLER, "rollout.pause": _CONTROLLER,
    "rollout.continue": _CONTROLLER, "env.reset": ("env",), "env.step": ("env",), "tool.call": ("env",), "sandbox.exec": ("env",),
    "reward.compute": _CONTROLLER, "reward_model.score": ("reward",),
    "preflight.check": _TRAIN,
}

# The routes each service serves (rpc.server.handle's peer is the path); tests check them against the services.
ROUTES: dict[str, tuple[str, ...]] = {
    "train": ("/sft_warm_start", "/begin_grpo", "/compute_logprobs", "/train_step", "/upload_weights",
              "/save_weights_dir", "/save", "/load", "/events", "/sft_begin", "/sft_step", "/sft_eval", "/sft_run_for",
              "/health", "/weights_checksum", "/heartbeat", "/shutdown", "/preflight", "/start_scheduler",
              "/weights_group", "/broadcast_weights", "/get_weights_by_name"),
    # sglang's routes (OpenAI's /v1 among them), then our extensions (/update_weights_from_meta, /events,
    # /weights_checksum, /rng_state, /rows)
    "rollout": ("/generate", "/update_weights_from_disk", "/init_weights_update_group",
                "/update_weights_from_distributed", "/destroy_weights_update_group", "/update_weight_version",
                "/release_memory_occupation",
                "/resume_memory_occupation", "/abort_request", "/pause_generation", "/continue_generation",
                "/flush_cache", "/health", "/health_generate", "/ready", "/model_info", "/get_model_info",
                "/server_info", "/get_server_info", "/get_weights_by_name", "/v1/models", "/v1/completions",
                "/v1/chat/completions", "/update_weights_from_meta", "/events", "/weights_checksum", "/rng_state",
                "/rows"),
    "metaserver": ("/versions", "/weights/{version}/{shard}", "/weights/{version}/manifest", "/weights/{version}",
                   "/health"),
    "scheduler": ("/jobs", "/jobs/{name}", "/lease", "/health"),
    "reward": ("/score", "/health"),
    "env": ("/reset", "/step", "/results", "/close", "/health"),
}

# Which requests may be repeated with the same effect (idempotent): the client retries only these (the policy's
# retry_idempotent). Every GET (health, heartbeat, checksums, shard pulls, model info) and every DELETE (stop a
# job, drop a weights version) is; so is a PUT of a weight shard (/weights/<version>/<shard>: the same shard again
# replaces it); of the POSTs, only these:
#   /compute_logprobs   a pure function of the weights and the batch it carries
#   /rng_state          sets the sampling generator to the state it carries
#   /start_scheduler    starts this node's scheduler once; again, it answers with the one running
#   /score              the reward server's scores: a pure function of the reward model and the texts
#   /get_weights_by_name  reads a parameter's first values (the spot check of stale weights)
#   /rows               a train rank's rows from a rollout host's store (rollout.data_plane store): a read; a reply
#                       whose checksum fails (stage_checksums) is fetched again from the rows the store still holds
# Never retried blindly: /train_step, /sft_step (an optimizer step each), /generate (new samples; migration is
# its own behaviour), /upload_weights, /save, /load, /update_weights_* (they move state), /events (the policy's
# acked_events delivers them, versioned, with its own attempts), /jobs (starts a process), /lease (its own loop).
IDEMPOTENT_POSTS = frozenset({"/compute_logprobs", "/rng_state", "/start_scheduler", "/score", "/get_weights_by_name",
                              "/rows"})


def idempotent(method: str, path: str) -> bool:
    """Whether repeating this request has the effect of sending it once."""
    route = path.split("?", 1)[0]
    return method in ("GET", "HEAD", "DELETE") or route in IDEMPOTENT_POSTS or \
        (method == "PUT" and route.startswith("/weights/"))


# What `target.peer` names at each point ({r}: any rank of the run); points not listed have no peer.
POINT_PEERS: dict[str, tuple[str, ...]] = {
    "rpc.client.send": ("train-{r}", "rollout-{r}", "metaserver-0", "scheduler-0", "reward-0", "env-0"),
    "events.notify": ("train-{r}", "rollout-{r}"),
    "events.handle": ("rollout_start", "rollout_end"),
    "scheduler.stop_job": ("scheduler-0",),
    "weights_update.upload": ("metaserver-0",),
    "weights_update.update": ("metaserver-0",),
    "weights_update.broadcast": ("weight_update_group",),
    "metaserver.put": ("rank{r}",),
    "metaserver.get": ("rank{r}", "manifest"),
}
