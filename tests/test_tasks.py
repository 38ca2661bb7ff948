"""Tasks and rewards."""

import json
import os

import pytest

from rlhf.config import ConfigError, TaskConfig
from rlhf.tasks import REWARDS, build_task


def test_exact_match_on_known_right_and_wrong_answers():
    reward = REWARDS["exact_match"]
    assert reward(["68", " 68 ", "86", "", "680"], ["68"] * 5, ["23+45="] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 completions and 1 answers"):
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


# ---------------------------------------------------------------- rewards people reach for, and their own


def test_built_in_rewards_on_known_right_and_wrong_completions():
    from rlhf.tasks.scoring import load_reward

    last, contains = REWARDS["last_number"], REWARDS["contains_answer"]
    assert last(completions=["10 + 4 = 14", "14.0", "it is 1,400", "no number", "14 then 15"],
                answers=["14", "14", "1400", "14", "14"]) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert contains(completions=["so 14 it is", "41", ""], answers=["14", "14", " "]) == [1.0, 0.0, 0.0]
    assert REWARDS["math_equal"](completions=["The answer is $\\frac{1}{2}$", "0.5", "1/3", "x"],
                                 answers=["0.5", "\\frac{1}{2}", "0.5", "2"]) == [1.0, 1.0, 0.0, 0.0]
    fmt = load_reward("format_regex", options={"pattern": r"^<think>.*</think>\s*\d+$"})
    assert fmt.fn(completions=["<think>a\nb</think> 7", "7", "<think></think>x"], **fmt.options) == [1.0, 0.0, 0.0]


REWARDS_FILE = '''
import asyncio
import math


def score(completions, answers, prompts, difficulty, **kwargs):
    """1 for the right answer, scaled by the row's difficulty column."""
    return [float(c.strip() == a) * d for c, a, d in zip(completions, answers, difficulty)]


def short(completions, **kwargs):
    return [1.0 if len(c) <= 3 else 0.0 for c in completions]


async def judge(completions, **kwargs):
    await asyncio.sleep(0)
    return [0.5] * len(completions)


def raises(completions, **kwargs):
    raise KeyError("no such column")


def too_few(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def text(completions, **kwargs):
    return [1.0, "yes"] + [0.0] * (len(completions) - 2)


def nan(completions, **kwargs):
    return [0.0, 0.0, math.nan][: len(completions)]


def inf(completions, **kwargs):
    return [math.inf] * len(completions)


async def slow(completions, **kwargs):
    await asyncio.sleep(30)
    return [0.0] * len(completions)
'''


@pytest.fixture()
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS_FILE)
    return str(path)


def test_rewards_from_a_file_and_a_package_weighted_with_the_rows_columns(rewards_file):
    from rlhf.tasks.scoring import Scorer, parse_rewards

    rewards = parse_rewards(f"{rewards_file}:score, rlhf.tasks.rewards:contains_answer,{rewards_file}:judge",
                            "1.0, 0.5, 2")
    assert [(r.fn.__name__, r.weight) for r in rewards] == [("score", 1.0), ("contains_answer", 0.5), ("judge", 2.0)]
    scorer = Scorer(rewards)
    total = scorer(["3", "x 4", "5"], ["3", "4", "6"], ["1+2=", "2+2=", "2+3="], {"difficulty": [2.0, 1.0, 1.0]})
    assert total == [2.0 + 0.5 + 1.0, 0.0 + 0.5 + 1.0, 0.0 + 0.0 + 1.0]
    assert scorer.means == {"reward_score": pytest.approx(2 / 3), "reward_contains_answer": pytest.approx(2 / 3),
                            "reward_judge": 0.5}
    with pytest.raises(ValueError, match=r"has no 'nope' \(its functions: .*score"):
        parse_rewards(f"{rewards_file}:nope", "")
    with pytest.raises(ValueError, match="2 weight\\(s\\) for 1 reward"):
        parse_rewards("last_number", "1,2")


@pytest.mark.parametrize("name, what", [
    ("raises", r"raised KeyError: 'no such column' \(scoring 3 completions; first prompt: 'p0'\)"),
    ("too_few", r"returned 2 values for 3 completions"),
    ("text", r"returned 'yes' \(str\), not a number: at row 1 \(prompt 'p1', completion 'b'\)"),
    ("nan", r"returned nan, not a finite number: at row 2 \(prompt 'p2', completion 'c'\)"),
    ("inf", r"returned inf, not a finite number: at row 0 \(prompt 'p0'"),
    ("slow", r"did not return within reward.async_timeout_s \(0.2 s\) for 3 completions"),
])
def test_a_bad_reward_is_one_error_naming_the_function_its_file_the_row_and_what(rewards_file, name, what):
    from rlhf.tasks.scoring import RewardError, Scorer, parse_rewards

    scorer = Scorer(parse_rewards(f"{rewards_file}:{name}", ""), timeout_s=0.2)
    with pytest.raises(RewardError, match=rf"reward '.*my_rewards.py:{name}' \(.*my_rewards.py\) {what}"):
        scorer(["a", "b", "c"], ["1", "2", "3"], ["p0", "p1", "p2"])


def test_reward_settings_are_checked_with_the_valid_choices(tmp_path, rewards_file):
    from rlhf.config import RewardConfig, build_config
    from rlhf.config.parse import apply_overrides
    from rlhf.inputs import input_problems

    with pytest.raises(ConfigError, match="'exact' is not a built-in reward; choose one of: contains_answer, "
                                          "exact_match, format_regex, last_number, math_equal"):
        RewardConfig(functions="exact")
    with pytest.raises(ConfigError, match="reward.weights: 1 weight\\(s\\) for 2 reward"):
        RewardConfig(functions="exact_match,last_number", weights="1")
    with pytest.raises(ConfigError, match="reward.format_regex: the format_regex reward needs a pattern"):
        RewardConfig(functions="format_regex")
    # a file that is not there is an input (rlhf.inputs), reported with every other missing input at once
    missing = apply_overrides(build_config("smoke"), {"reward": {"functions": "missing.py:score"},
                                                      "task": {"path": str(tmp_path / "nowhere.jsonl")}})
    assert input_problems(missing, world=1) == [
        f"reward.functions: file 'missing.py' does not exist (from {os.getcwd()})",
        f"task.path: {str(tmp_path / 'nowhere.jsonl')!r} does not exist (a JSONL, Parquet or CSV file, or a Hugging "
        "Face datasets directory)"]
    cfg = apply_overrides(build_config("smoke"), {"reward": {"functions": [f"{rewards_file}:short", "last_number"],
                                                             "weights": [0.2, 1.0]}})
    assert cfg.reward.functions == f"{rewards_file}:short,last_number" and cfg.reward.weights == "0.2,1.0"


# ---------------------------------------------------------------- datasets in the formats people keep


ROWS = [{"question": f"{i}+1=", "solution": i + 1, "level": i % 3} for i in range(12)]


def _write(tmp_path, kind):
    if kind == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif kind == "csv":
        path = tmp_path / "d.csv"
        path.write_text("question,solution,level\n" + "".join(f"{r['question']},{r['solution']},{r['level']}\n"
                                                             for r in ROWS))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    else:
        import datasets

        path = tmp_path / "hf"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                              "test": datasets.Dataset.from_list(ROWS[:2])}).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "datasets"])
def test_a_dataset_in_each_format_with_its_own_keys_keeps_the_other_columns(tmp_path, kind):
    cfg = TaskConfig(path=_write(tmp_path, kind), prompt_key="question", answer_key="solution", eval_size=3,
                     val_size=2)
    assert cfg.name == "dataset"  # a task.path is enough
    task = build_task(cfg)
    rows = task.split("eval") + task.split("val") + task.split("train")
    assert sorted((e.prompt, e.answer) for e in rows) == sorted((r["question"], str(r["solution"])) for r in ROWS)
    level = {r["question"]: r["level"] for r in ROWS}
    assert all(int(e.fields["level"]) == level[e.prompt] for e in rows)  # CSV keeps text: "1"


def test_bad_datasets_name_the_file_the_row_and_the_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n" + json.dumps({"prompt": "b", "answer": None})
                    + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2: field 'answer' must be a string or a number, got nothing"):
        build_task(TaskConfig(path=str(path), eval_size=1, val_size=1))
    path.write_text(json.dumps({"q": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: field\(s\) \['prompt', 'answer'\] missing \(its fields: q; set "
                                         r"task.prompt_key / task.answer_key\)"):
        build_task(TaskConfig(path=str(path), eval_size=1, val_size=1))
    csv_path = tmp_path / "d.csv"
    csv_path.write_text("prompt,answer\nx,1\n,2\n")
    with pytest.raises(ValueError, match=r"d.csv:3: field 'prompt' must be a non-empty string or a list of chat"):
        build_task(TaskConfig(path=str(csv_path), eval_size=1, val_size=1))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ValueError, match=r"unknown kind '.txt'; expected .jsonl/.json, .parquet, .csv"):
        build_task(TaskConfig(path=str(tmp_path / "d.txt"), eval_size=1, val_size=1))
    hf = _write(tmp_path, "datasets")
    with pytest.raises(ValueError, match=r"task.split 'validation' is not one of its splits: train, test"):
        build_task(TaskConfig(path=hf, split="validation", prompt_key="question", answer_key="solution",
                              eval_size=1, val_size=1))


def test_chat_message_prompts_are_rendered_by_the_chat_template(tmp_path):
    from rlhf.data import encode_prompts
    from rlhf.models import load_tokenizer
    from rlhf.models.hf_dir import CHATML, write_model_dir

    path = tmp_path / "chat.jsonl"
    chat = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2="}]
    path.write_text("".join(json.dumps({"prompt": chat, "answer": str(i)}) + "\n" for i in range(5)))
    task = build_task(TaskConfig(path=str(path), eval_size=1, val_size=1))
    assert task.split("eval")[0].prompt == chat
    tok = load_tokenizer(write_model_dir(str(tmp_path / "model"), chat_template=CHATML))
    ids = encode_prompts(tok, [chat])[0]
    assert ids == tok.encode(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)


def test_a_grpo_run_on_a_parquet_file_with_rewards_from_a_file_logs_each_reward_and_a_bad_one_stops_it(tmp_path):
    """The README's command: --task.path data.parquet --reward.functions my_rewards.py:fn (here with a built-in beside it,
    weighted). Each reward function's mean is a steps.csv column; a reward that returns NaN at step 2 stops the run
    there, in the reward stage, with one error naming the function, its file, the row and what was wrong."""
    import csv
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import ROOT

    data = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"{a}+{b}=", "answer": str(a + b), "difficulty": 1.0 + a % 2}
                                         for a in range(20) for b in range(20)]), data)
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(REWARDS_FILE)

    def run(reward, weights, run_dir):
        return subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--preset", "smoke", "--steps", "2",
                               "--task.path", str(data), "--reward.functions", reward, "--reward.weights", weights,
                               "--task.eval_size", "8", "--task.val_size", "8", "--sft.max_steps", "0",
                               "--algorithm.resample_rounds", "0",  # one reward call a step: the 2nd is step 2's
                               "--run-dir", str(run_dir)],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)

    rewards.write_text(REWARDS_FILE + """
CALLS = []


def second_step_fails(completions, **kwargs):
    if len(completions) == 16:  # a GRPO step's batch (4 prompts x 4 samples); the evaluations score 8
        CALLS.append(1)
        if len(CALLS) == 2:
            return [float("nan")] * len(completions)
    return [0.0] * len(completions)
""")
    out = run(f"{rewards}:score,last_number,{rewards}:second_step_fails", "1,0.5,1", tmp_path / "run")
    assert out.returncode != 0
    with open(tmp_path / "run" / "steps.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 1 and 0.0 <= float(rows[0]["reward_score"]) <= 2.0
    assert 0.0 <= float(rows[0]["reward_last_number"]) <= 1.0 and float(rows[0]["reward_second_step_fails"]) == 0.0
    assert "step 2, stage reward" in out.stderr and "my_rewards.py:second_step_fails' (" in out.stderr, \
        out.stderr[-3000:]
    assert "returned nan, not a finite number: at row 0 (prompt '" in out.stderr
