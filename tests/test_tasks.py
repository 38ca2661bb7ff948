"""Tasks and rewards."""

import json

import pytest

from rlhf.config import ConfigError, TaskConfig
from rlhf.tasks import REWARDS, build_task


def test_exact_match_on_known_right_and_wrong_answers():
    reward = REWARDS["exact_match"]
    assert reward(["68", " 68 ", "86", "", "680"], ["68"] * 5, ["23+45="] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 completions, 1 answers"):
        reward(["1", "2"], ["1"], ["p"])


def test_arithmetic_answers_are_correct_and_splits_disjoint_and_deterministic():
    task = build_task(TaskConfig(max_operand=30, operations="+-", eval_size=200, val_size=50))
    splits = {name: task.split(name) for name in ("train", "val", "eval")}
    assert len(splits["eval"]) == 200 and len(splits["val"]) == 50
    assert len(splits["train"]) == 2 * 31 * 31 - 250
    prompts = {name: {e.prompt for e in ex} for name, ex in splits.items()}
    assert not (prompts["train"] & prompts["eval"]) and not (prompts["train"] & prompts["val"])
    assert not (prompts["val"] & prompts["eval"])
    for e in splits["eval"]:
        assert str(eval(e.prompt[:-1])) == e.answer  # noqa: S307 - our own generated arithmetic
    again = build_task(TaskConfig(max_operand=30, operations="+-", eval_size=200, val_size=50))
    assert again.split("eval") == splits["eval"]
    other = build_task(TaskConfig(max_operand=30, operations="+-", eval_size=200, val_size=50, seed=1))
    assert other.split("eval") != splits["eval"]


def test_jsonl_task_reads_rows_and_names_bad_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": f"q{i}", "answer": f"a{i}"} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = build_task(TaskConfig(name="jsonl", path=str(path), eval_size=3, val_size=2))
    assert len(task.split("train")) == 5
    assert {e.prompt for e in task.split("eval") + task.split("val") + task.split("train")} == {r["prompt"] for r in rows}
    path.write_text(json.dumps(rows[0]) + "\n" + '{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"data.jsonl:2: field\(s\) \['answer'\]"):
        build_task(TaskConfig(name="jsonl", path=str(path), eval_size=1, val_size=1))
    with pytest.raises(ConfigError, match="task.path: required"):
        TaskConfig(name="jsonl")
