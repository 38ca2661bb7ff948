"""The resilience policy: presets, one behaviour switched alone, recorded in config.yaml, seen by every process."""

import dataclasses

import pytest
import yaml

from rlhf.cli_args import make_parser, parse_config
from rlhf.config import ConfigError, build_config
from rlhf.runtime.resilience import FAITHFUL, HARDENED, Policy


def parse(*argv):
    return parse_config(list(argv), make_parser("t", "t"))[0]


def test_presets_set_every_behaviour_and_differ_in_all_of_them():
    behaviours = Policy.behaviours()
    assert len(behaviours) >= 8 and "preset" not in behaviours
    assert all(getattr(HARDENED, b) for b in behaviours) and not any(getattr(FAITHFUL, b) for b in behaviours)
    assert build_config().resilience == HARDENED  # the default run is hardened


def test_one_behaviour_switched_on_top_of_a_preset():
    cfg = parse("--resilience", "hardened", "--resilience.first_failure_ledger", "false")
    assert cfg.resilience == dataclasses.replace(HARDENED, first_failure_ledger=False)
    assert cfg.resilience.describe() == "hardened with first_failure_ledger off"
    cfg = parse("--resilience", "faithful", "--resilience.atomic_checkpoints")  # a bare flag means true
    assert cfg.resilience.changed() == {"atomic_checkpoints": True} and not cfg.resilience.typed_errors


def test_a_preset_resets_what_came_before_it_and_later_keys_win():
    # a scenario file picks faithful; the command line then picks hardened: every behaviour follows
    cfg = build_config(scenario=[("resilience.preset", "faithful")], dotted=[("resilience.preset", "hardened")])
    assert cfg.resilience == HARDENED
    cfg = build_config(scenario=[("resilience.preset", "faithful")], dotted=[("resilience.typed_errors", "true")])
    assert cfg.resilience.preset == "faithful" and cfg.resilience.changed() == {"typed_errors": True}


def test_config_yaml_records_the_resolved_policy_and_reads_back_the_same(tmp_path):
    cfg = parse("--resilience", "faithful", "--resilience.stage_checksums", "true")
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    written = yaml.safe_load(path.read_text())["resilience"]
    assert written["preset"] == "faithful" and written["stage_checksums"] is True and written["typed_errors"] is False
    assert set(written) == {"preset", *Policy.behaviours()}
    assert build_config(config_file=str(path)).resilience == cfg.resilience  # what every other process reads


@pytest.mark.parametrize("argv, message", [
    (["--resilience.preset", "strict"], "resilience.preset: 'strict' is not valid; choose one of: faithful, hardened"),
    (["--resilience.first_failure", "true"], "did you mean 'resilience.first_failure_ledger'"),
    (["--resilience.typed_errors", "maybe"], "resilience.typed_errors: expected a boolean"),
    (["--runtime.resilience", "faithful"], "has moved: use resilience.preset"),
])
def test_bad_resilience_input_names_the_key_and_the_choices(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err


def test_help_lists_every_behaviour_with_its_doc(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out
    for b in Policy.behaviours():
        assert f"--resilience.{b} BOOL" in out
    assert "first failure" in out


def test_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        HARDENED.typed_errors = False  # type: ignore[misc]
    with pytest.raises(ConfigError):
        Policy(preset="nope")
