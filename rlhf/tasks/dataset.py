"""Rows from the user's data: `--task.path` names a JSONL (.jsonl, .json: one object per line), Parquet or CSV file,
or a Hugging Face datasets directory (`save_to_disk`; `--task.split` picks a split of a DatasetDict).

Each row's prompt is column task.prompt_key (a string, or a list of chat messages {role, content}, rendered by the
tokenizer's chat template) and its answer column task.answer_key (a string, or a number written as text); every other
column is kept and reaches the reward functions (and an environment's reset) as a keyword argument. A SkyRL-format
row (a `prompt` of chat messages, `env_class`, `reward_spec`, `extra_info`) loads as it is: without an answer column,
the answer is its reward_spec's ground_truth. A file that cannot be read, or a row without
a usable prompt or answer, is one error naming the file, the row (its line in a JSONL or CSV file) and the field.
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, Iterator

from rlhf.tasks.base import Example, Task, register_task, split_examples

FORMATS = ".jsonl/.json, .parquet, .csv, or a Hugging Face datasets directory (save_to_disk)"


def _jsonl(path: str) -> Iterator[tuple[str, dict]]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {err.msg} (column {err.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
            yield f"{path}:{lineno}", row


def _csv(path: str) -> Iterator[tuple[str, dict]]:
    with open(path, encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        for row in reader:
            yield f"{path}:{reader.line_num}", dict(row)


def _parquet(path: str) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow (or rlhf[data])") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 — pyarrow's errors vary; the file is what the user needs to know
        raise ValueError(f"{path}: not a readable Parquet file: {type(exc).__name__}: {exc}") from None
    for i, row in enumerate(rows):
        yield f"{path}: row {i}", row


def _hf_dir(path: str, split: str) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{path}: a datasets directory needs the datasets package: pip install datasets "
                          "(or rlhf[data])") from None
    try:
        data = datasets.load_from_disk(path)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{path}: not a Hugging Face datasets directory (save_to_disk): {type(exc).__name__}: "
                         f"{exc}") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"{path}: task.split {split!r} is not one of its splits: {', '.join(data)}")
        data, where = data[split], f"{path} [{split}]"
    else:
        where = path
    for i, row in enumerate(data):
        yield f"{where}: row {i}", row


def read_rows(path: str, split: str = "train") -> Iterator[tuple[str, dict]]:
    """(where, row) of every row of the file or directory, by its kind."""
    if os.path.isdir(path):
        return _hf_dir(path, split)
    if not os.path.isfile(path):
        raise ValueError(f"task.path: {path!r} does not exist (expected {FORMATS})")
    ext = os.path.splitext(path)[1].lower()
    readers = {".jsonl": _jsonl, ".json": _jsonl, ".parquet": _parquet, ".csv": _csv}
    if ext not in readers:
        raise ValueError(f"task.path: {path!r}: unknown kind {ext or '(no extension)'!r}; expected {FORMATS}")
    return readers[ext](path)


def _prompt(value: Any, where: str, key: str) -> str | list[dict]:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ValueError(f"{where}: field {key!r} must be a non-empty string or a list of chat messages "
                     f"{{role, content}}, got {_show(value)}")


def _answer(value: Any, where: str, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return str(int(value)) if float(value).is_integer() else str(value)
    raise ValueError(f"{where}: field {key!r} must be a string or a number, got {_show(value)}")


def _show(value: Any) -> str:
    return "nothing (missing)" if value is None else f"{type(value).__name__} {str(value)[:60]!r}"


@register_task("dataset")
@register_task("jsonl")
class DatasetTask(Task):
    def __init__(self, cfg: Any) -> None:
        examples = []
        pk, ak = cfg.prompt_key, cfg.answer_key
        for where, row in read_rows(cfg.path, cfg.split):
            spec = row.get("reward_spec")
            if ak not in row and isinstance(spec, dict) and "ground_truth" in spec:  # SkyRL's format, as it is
                row = {**row, ak: spec["ground_truth"]}
            if pk not in row or ak not in row:
                missing = [k for k in (pk, ak) if k not in row]
                raise ValueError(f"{where}: field(s) {missing} missing (its fields: {', '.join(map(str, row))}; "
                                 "set task.prompt_key / task.answer_key)")
            prompt = _prompt(row[pk], where, pk)
            answer = _answer(row[ak], where, ak)
            examples.append(Example(prompt, answer, {k: v for k, v in row.items() if k not in (pk, ak)}))
        self.splits = split_examples(examples, cfg, cfg.path)
