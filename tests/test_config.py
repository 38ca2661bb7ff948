"""Config: presets, YAML, dotted overrides, validation messages, --help."""

import subprocess
import sys

import pytest

from rlhf.config import ConfigError, build_config, parse_overrides
from tests.conftest import ROOT


def test_dotted_overrides_convert_types():
    pairs, rest = parse_overrides(["--rollout.group_size", "4", "--algorithm.kl_coef=0.5",
                                   "--algorithm.scale_by_std", "--seed", "3"])
    assert rest == ["--seed", "3"]
    cfg = build_config(dotted=pairs, top_level={"seed": 3})
    assert cfg.rollout.group_size == 4 and cfg.algorithm.kl_coef == 0.5 and cfg.algorithm.scale_by_std is True
    assert cfg.seed == 3
    cfg = build_config(dotted=[("algorithm.scale_by_std", "false")])
    assert cfg.algorithm.scale_by_std is False


@pytest.mark.parametrize("pairs, message", [
    ([("algorithm.aggregation", "mean")], "algorithm.aggregation: 'mean' is not valid.*choose one of: token_mean, sequence_mean"),
    ([("rollout.group_sise", "4")], "unknown config key 'rollout.group_sise' \\(did you mean 'rollout.group_size'\\?\\)"),
    ([("rollout.group_size", "four")], "rollout.group_size: expected int, got 'four'"),
    ([("sampling.temperature", "-1")], "sampling.temperature: must be >= 0"),
    ([("model.name", "gpt5")], "model.name: 'gpt5' is not valid; choose one of: tiny-llama"),
    ([("algorithm.scale_by_std", "maybe")], "expected a boolean"),
    ([("sft.band_low", "0.6"), ("sft.band_high", "0.5")], "sft.band_high \\(0.5\\) must be >= sft.band_low"),
    ([("weights.transport", "nccl")], "weights.transport: 'nccl' is not valid.*choose one of: shm, http, cuda_ipc"),
    ([("weights.transport", "cuda_ipc")], "cuda_ipc' shares GPU memory; model.device is 'cpu' \\(choose model.device cuda"),
    ([("weights.transport", "cuda_ipc"), ("model.device", "cuda"), ("weights.mode", "disk")],
     "'cuda_ipc' is how the MetaServer's shards travel; weights.mode is 'disk'"),
    ([("weights.transport", "cuda_ipc"), ("weights.checksum", "crc32")], "weights.checksum: 'crc32' digests bytes in transit"),
    ([("rollout.mode", "asynch")], "rollout.mode: 'asynch' is not valid \\(did you mean 'async'\\?\\); choose one of: sync, async"),
    ([("rollout.max_staleness", "-1")], "rollout.max_staleness: must be >= 0"),
    ([("algorithm.off_policy", "tis")], "algorithm.off_policy: 'tis' .*set algorithm.old_logprobs recompute"),
    ([("rollout.interrupt", "pause")], "rollout.interrupt: 'pause' is not valid; choose one of: retract, in_place, abort"),
    ([("rollout.mode", "async"), ("runtime.colocate", "true")], "rollout.mode: 'async' generates while the train ranks"),
])
def test_bad_values_name_the_key_and_the_valid_choices(pairs, message):
    with pytest.raises(ConfigError, match=message):
        build_config(dotted=pairs)


def test_yaml_file_applies_and_errors_name_the_line(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("rollout:\n  group_size: 16\ntrain:\n  lr: 0.0005\n")
    cfg = build_config(config_file=str(good), dotted=[("train.lr", "1e-4")])
    assert cfg.rollout.group_size == 16 and cfg.train.lr == 1e-4  # the command line wins
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  group_size: 16\n   top_p: [1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3: YAML syntax error"):
        build_config(config_file=str(bad))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("rolout:\n  group_size: 4\n")
    with pytest.raises(ConfigError, match=r"unknown.yaml: unknown config key 'rolout' \(did you mean 'rollout'\?\)"):
        build_config(config_file=str(unknown))


def test_help_lists_every_key_with_its_doc_and_bad_flags_exit_2():
    script = f"{ROOT}/examples/grpo_trainer.py"
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert "--rollout.group_size" in out.stdout and "samples generated per prompt" in out.stdout
    assert "--algorithm.aggregation" in out.stdout and "--sft.band_low" in out.stdout
    bad = subprocess.run([sys.executable, script, "--algorithm.loss", "ppo"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "algorithm.loss: 'ppo' is not valid" in bad.stderr and "grpo" in bad.stderr


def test_a_missing_or_unusable_model_dir_or_jsonl_file_is_one_line_before_anything_starts(tmp_path, capsys):
    from rlhf.cli_args import make_parser, parse_config

    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(["--model.path", str(tmp_path / "none")], "is not a directory", None),
             (["--model.path", str(empty)], "has no config.json", None),
             (["--model.path", str(empty)], "is not readable JSON: Expecting ',' delimiter: line 2 column 3",
              '{"model_type": "llama"\n  "vocab_size": 99}'),
             (["--model.path", str(empty)], 'has no "model_type"', '{"vocab_size": 99}'),
             (["--model.path", str(empty)], "model_type 'gpt2' is not one the native rollout engine runs; valid: "
              "llama, mistral, qwen2", '{"model_type": "gpt2"}'),
             (["--task.name", "jsonl", "--task.path", str(tmp_path / "none.jsonl")], "task.path: ", None)]
    for argv, says, config_json in cases:
        if config_json is not None:
            (empty / "config.json").write_text(config_json)
        with pytest.raises(SystemExit) as stop:
            parse_config(argv, make_parser("grpo_trainer.py", "test"))
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("grpo_trainer.py: error: ") and says in err, err
    (empty / "config.json").write_text('{"model_type": "qwen2"}')
    data = tmp_path / "add.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg, _ = parse_config(["--model.path", str(empty), "--task.name", "jsonl", "--task.path", str(data)],
                          make_parser("grpo_trainer.py", "test"))
    assert cfg.model.path == str(empty) and cfg.task.path == str(data)


def test_the_keys_of_the_sections_by_concept_keep_working_under_their_old_names(caplog):
    """Each section that moved (sampling and sglang out of rollout, the reward functions out of task, the reward
    model in its own section, the layout out of train, the timeouts out of runtime) reads its old flag in the new
    place, one deprecation line each; the old name and the new one together are an error."""
    from rlhf.config import MOVED_KEYS

    old = [("rollout.temperature", "0.5"), ("rollout.sglang_launcher", "rlhf.services.sglang_launch"),
           ("task.reward", "last_number"), ("task.reward_timeout_s", "9"), ("reward.weight", "0.5"),
           ("reward.model_path", ""), ("train.parallel", "fsdp"), ("train.tp_size", "1"),
           ("runtime.rpc_timeout_s", "7"), ("runtime.scheduler_lease_s", "3")]
    with caplog.at_level("WARNING", logger="rlhf.config"):
        cfg = build_config(dotted=old)
    moved = [r.getMessage() for r in caplog.records if "has moved" in r.getMessage()]
    assert sorted(moved) == sorted(f"config key {key} has moved to {MOVED_KEYS[key]}: read as {MOVED_KEYS[key]} "
                                  f"{value} (the old name will go)" for key, value in old)
    assert (cfg.sampling.temperature, cfg.sglang.launcher, cfg.reward.functions, cfg.reward.async_timeout_s) == \
        (0.5, "rlhf.services.sglang_launch", "last_number", 9)
    assert (cfg.reward_model.weight, cfg.parallel.layout, cfg.timeouts.rpc_s, cfg.timeouts.scheduler_lease_s) == \
        (0.5, "fsdp", 7, 3)
    with pytest.raises(ConfigError, match="'train.parallel' has moved to 'parallel.layout', and both are given"):
        build_config(dotted=[("train.parallel", "fsdp"), ("parallel.layout", "dp")])
    for new in MOVED_KEYS.values():  # every new place exists
        section, key = new.split(".")
        assert hasattr(getattr(cfg, section), key), new
