"""The rollout's sections: rollout (what a step generates and by which servers, sync or async), sampling (sglang's
sampling_params of every /generate), sglang (how a real sglang server is launched). Each field's docstring is what
`--help` prints; each section validates its values in __post_init__ (what needs the disk or an import is checked in
inputs.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rlhf.config.checks import ConfigError, _choice, _positive


@dataclass
class RolloutConfig:
    """What a GRPO step generates, by which servers, and when (sync or async)."""

    group_size: int = 8
    """GRPO group size: samples generated per prompt (sglang's `n`)."""
    prompts_per_step: int = 64
    """Distinct prompts per GRPO step; the batch is prompts_per_step * group_size samples. 64: at 32 the default run's gradient was noise-dominated and its gain depended on the seed (docs/results.md: the default run, version by version)."""
    servers: int = 1
    """Rollout server processes (jobs of the scheduler) when run under the distributed runtime."""
    backend: str = "native"
    """Rollout servers: 'native' (our engine, with our extensions: MetaServer pulls, /events, checksums) or
    'sglang' (a real sglang server per job, driven through sglang's own routes only; needs weights.mode
    distributed or disk, and model.path; its launch flags are the sglang section)."""
    mode: str = "sync"
    """'sync': each step generates its batch with the step's weights, then trains on it (the seeds' system). 'async':
    a producer generates the next steps' batches while the train ranks train, each sample at most
    rollout.max_staleness weights versions older than the step that trains on it (docs/async.md)."""
    max_staleness: int = 1
    """rollout.mode async: K, how many weights versions a trained-on sample may lag the step's (a sample generated
    by version v is trained at a step <= v + K); 0 is the synchronous run through the async path."""
    interrupt: str = "retract"
    """rollout.mode async: how each weights update pauses the rollout servers (sglang's /pause_generation mode,
    then /continue_generation after the update). retract: running requests stop at the next decode step, keep their
    tokens and go on from them after the update (re-prefilled under the new weights; each token's version in
    meta_info output_token_weight_versions, and a sample's staleness counts its oldest token's); in_place: running
    requests stop at the next decode step and keep their KV cache; after the update they go on from it under the
    new weights (no re-prefill, each token's version recorded); abort: running
    requests end now with their tokens (finish_reason abort) and, with resilience.migrate_requests, continue from
    them under the new weights."""
    data_plane: str = "auto"
    """Where the step's rows (token ids and logprobs) travel. auto: store in a simulated world (sim.train_ranks),
    controller otherwise. controller: every /generate reply comes to the
    controller, which sends each train rank its share (the seeds' system). store: they stay in the rollout servers
    that generated them (a store per rollout process, keyed by row ids the controller assigns); the servers score
    them with the reward functions and answer with metadata only (lengths, rewards, versions); each train rank fetches
    its own share by id (POST /rows) and keeps it from the reference pass to the train step, so no token passes
    through the controller (docs/scale.md). store needs the native backend, no env.path and no reward_model.path;
    aborted samples are not continued from their tokens there (they are generated again when migrated)."""
    buffer: str = "batch"
    """rollout.mode async: what the producer generates and the buffer holds. batch: whole batches, each generated
    with one call per server and ready when its slowest sample is. group: group by group, calls of rollout.groups_per_call
    groups (round robin over the servers), each group in the buffer as soon as its call ends; a step takes the first groups that
    fill its batch, each within rollout.max_staleness of the step by its oldest token, and a long-tail group joins a
    later step's batch instead of holding this one (docs/async.md)."""
    groups_per_call: int = 0
    """rollout.buffer group: groups a /generate call generates together (a native engine runs one call at a time: one
    group a call loses the batching across groups; an sglang server batches across calls). 0: auto,
    prompts_per_step / (4 x rollout.servers), at least 1."""
    max_queued_requests: int = 16
    """Calls a rollout server lets wait for its engine; with the policy's shed_load on, one more is answered 503
    with Retry-After and the client sends it again after that (sglang's --max-queued-requests); 0: no limit."""

    @property
    def per_call(self) -> int:
        """rollout.groups_per_call resolved (0: auto)."""
        return self.groups_per_call or max(1, self.prompts_per_step // (4 * self.servers))

    @property
    def overlaps(self) -> bool:
        """Whether the rollout servers generate while the train ranks train (async with K >= 1; K = 0 takes turns)."""
        return self.mode == "async" and self.max_staleness > 0

    def __post_init__(self) -> None:
        _positive("rollout.group_size", self.group_size)
        _positive("rollout.prompts_per_step", self.prompts_per_step)
        _positive("rollout.servers", self.servers)
        _choice("rollout.backend", self.backend, ("native", "sglang"))
        _choice("rollout.mode", self.mode, ("sync", "async"))
        _positive("rollout.max_staleness", self.max_staleness, allow_zero=True)
        _choice("rollout.interrupt", self.interrupt, ("retract", "in_place", "abort"))
        _choice("rollout.data_plane", self.data_plane, ("auto", "controller", "store"))
        _choice("rollout.buffer", self.buffer, ("batch", "group"))
        _positive("rollout.groups_per_call", self.groups_per_call, allow_zero=True)
        if self.buffer == "group" and self.mode != "async":
            raise ConfigError(f"rollout.buffer: 'group' is how the async producer generates; rollout.mode is "
                              f"{self.mode!r} (set rollout.mode async, or leave rollout.buffer batch)")
        _positive("rollout.max_queued_requests", self.max_queued_requests, allow_zero=True)


@dataclass
class SamplingConfig:
    """The sampling_params of every training /generate call (greedy evaluation sets its own)."""

    max_new_tokens: int = 6
    """Longest completion in tokens; longer samples stop with finish_reason 'length'."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy. Logprobs are of the temperature-scaled distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 disables it (sglang's convention)."""
    seed: int = -1
    """Sampling seed; -1 derives it from the run seed."""
    ignore_eos: bool = False
    """Generate max_new_tokens for every sample, past EOS (benchmarks: fixed work per step)."""

    def __post_init__(self) -> None:
        _positive("sampling.max_new_tokens", self.max_new_tokens)
        _positive("sampling.temperature", self.temperature, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p: must be in (0, 1], got {self.top_p!r}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"sampling.top_k: must be -1 (off) or >= 1, got {self.top_k!r}")


@dataclass
class SglangConfig:
    """With rollout.backend sglang: how the scheduler launches each real sglang server."""

    launcher: str = "sglang.launch_server"
    """The module the scheduler runs as `python -m MODULE --config FILE` (sglang's launch flags in a YAML file, the
    API key among them). rlhf.services.sglang_launch is our engine behind exactly sglang's routes (tests, CPU
    machines)."""
    mem_fraction: float = 0.85
    """--mem-fraction-static, the share of GPU memory sglang takes for weights and KV cache."""
    tp_size: int = 1
    """--tp-size, GPUs per rollout server (tensor parallel)."""

    def __post_init__(self) -> None:
        if self.launcher == "rlhf.runtime.sglang_launch":  # the module's name before the layers' folders
            logging.getLogger("rlhf.config").warning(
                "sglang.launcher rlhf.runtime.sglang_launch has moved: use rlhf.services.sglang_launch")
            self.launcher = "rlhf.services.sglang_launch"
        _positive("sglang.tp_size", self.tp_size)
        if not 0 < self.mem_fraction <= 1:
            raise ConfigError(f"sglang.mem_fraction: must be in (0, 1], got {self.mem_fraction!r}")


@dataclass
class EnvConfig:
    """Multi-turn episodes: an environment answers each turn of the model (docs/environments.md). Off by default."""

    path: str = ""
    """The environment: a built-in (tool_calls), path/to/file.py:Class or package.module:Class (reset(row) -> text,
    step(action) -> StepResult), or another trainer's class run unchanged (a SkyRL-gym BaseTextEnv, skyrl_gym:<id>, skyrl_gym
    for each row's env_class, a gymnasium-style text environment: docs/environments.md); empty: one completion a prompt, no environment."""
    tools: str = ""
    """tool_calls: the file (path/to/tools.py) or module whose public functions the model may call."""
    max_turns: int = 4
    """The most model turns an episode has (each up to sampling.max_new_tokens tokens); the last turn's text is the
    answer the reward functions score."""
    max_tool_output_tokens: int = 64
    """An observation (a tool's answer) is cut to this many tokens before it is appended."""
    on_infra_error: str = "auto"
    """A tool whose infrastructure failed (InfraError, an OSError: its service unreachable, a sandbox killed from
    outside or starved of CPU past its time limit). fail: the step fails naming the tool (the model never reads it);
    retry: the call is made again, up to env.infra_retries more times with a growing wait between (a WARNING each;
    steps.csv infra_retries), and fails the step as fail does when none succeeds; drop_group: that episode's group
    leaves the step's batch (a WARNING; steps.csv dropped_groups; every group lost fails the step); model: the model
    reads the error as the tool's answer (verl's behaviour; steps.csv infra_errors counts it); auto:
    resilience.infra_errors_fail and retry_infra_errors decide (retry in hardened, model in faithful)."""
    infra_retries: int = 3
    """env.on_infra_error retry: how many times a failed call is made again (waits of 0.2 s doubling to 5 s, with
    jitter); a tool that is retried must be safe to run twice."""
    parallel_calls: int = 8
    """The environment server steps this many episodes of a turn at once (threads: a tool that waits on a service or
    a sandbox process overlaps the others'; the turn takes its slowest step, not their sum); 1: one after another."""
    batch_wait_s: float = 0.05
    """Episodes advance independently: a free rollout server waits up to this long (from the oldest ready episode)
    for episodes whose environment steps are still running, to generate their turns in one call. 0: at once; a large
    value: the step's episodes go turn by turn together (lockstep: every turn waits for its slowest step)."""
    sandbox_timeout_s: float = 5.0
    """The python tool (env.tools rlhf.envs.sandbox): wall-clock seconds a run may take (its process group is killed
    past it)."""
    sandbox_cpu_s: int = 5
    """The python tool: CPU seconds a run may use (RLIMIT_CPU)."""
    sandbox_memory_mb: int = 512
    """The python tool: the address space a run may map, MB (RLIMIT_AS)."""
    max_processes: int = 512
    """env-0 and everything it starts (a helper server, a browser, a shell, however it detaches: setsid, a double fork) live in a cgroup of their own, killed with it when env-0 stops, dies or is started again; at most this many processes in it (cgroup pids.max; 0: no limit). Without cgroups (not root) env-0 keeps its orphans as a child subreaper and stops them as it exits, and says so."""
    memory_mb: float = 0.0
    """The memory env-0 and everything it starts may use together, MB (cgroup memory.max; 0: no limit)."""

    def __post_init__(self) -> None:
        _positive("env.max_turns", self.max_turns)
        _positive("env.max_tool_output_tokens", self.max_tool_output_tokens)
        _positive("env.parallel_calls", self.parallel_calls)
        _choice("env.on_infra_error", self.on_infra_error, ("auto", "fail", "retry", "drop_group", "model"))
        _positive("env.infra_retries", self.infra_retries)
        if self.batch_wait_s < 0:
            raise ConfigError(f"env.batch_wait_s: must be >= 0 seconds, got {self.batch_wait_s!r}")
        _positive("env.sandbox_timeout_s", self.sandbox_timeout_s)
        _positive("env.sandbox_cpu_s", self.sandbox_cpu_s)
        _positive("env.sandbox_memory_mb", self.sandbox_memory_mb)
        _positive("env.max_processes", self.max_processes, allow_zero=True)
        _positive("env.memory_mb", self.memory_mb, allow_zero=True)
        if self.path == "tool_calls" and not self.tools:
            raise ConfigError("env.tools: env.path tool_calls needs the file or module of its tools "
                              "(e.g. --env.tools examples/envs/calculator.py)")


@dataclass
class AgentConfig:
    """An agent harness drives the policy (docs/environments.md, "Agents"): your function, given an OpenAI client whose
    base URL is the run's rollout side and the dataset row, runs any loop with any tools; every completion it makes is
    recorded token for token and trained on. Off by default."""

    path: str = ""
    """The agent: path/to/file.py:fn or package.module:fn; `async def fn(client, row)` gets an openai.AsyncOpenAI,
    `def fn(client, row)` an openai.OpenAI (run in a thread); it returns the episode's reward, or None to leave it to
    the reward functions (which score its last completion's text). Empty: no agent."""
    max_calls: int = 8
    """The most completions an episode may ask for; the next one is answered with OpenAI's 400 error."""
    timeout_s: float = 300.0
    """Wall seconds an episode may run; past them the step fails naming the agent's row and its last call (the
    stall watchdog, runtime.watchdog_stall_s, names an episode that has made no call for that long before)."""

    def __post_init__(self) -> None:
        _positive("agent.max_calls", self.max_calls)
        _positive("agent.timeout_s", self.timeout_s)
        if self.path and ":" not in self.path.rsplit("/", 1)[-1]:
            raise ConfigError(f"agent.path: {self.path!r} names no function (path/to/file.py:fn or package.module:fn)")
