"""Building a config: a preset, then a YAML file, then dotted overrides (--section.field VALUE); --help's text
from the field docstrings."""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import logging
import textwrap
import typing
from typing import Any

import yaml

from rlhf.config.checks import ConfigError, _choice
from rlhf.config.presets import PRESETS
from rlhf.config.sections import Config

# an old dotted key -> where it lives now: a file or flag that still uses the old name keeps working, with one
# deprecation line (a section that moves lists each of its keys here)
MOVED_KEYS = {
    "runtime.resilience": "resilience.preset",
    # the sections by concept: sampling and sglang out of rollout, the reward functions out of task, the reward
    # model in a section of its own, the layout out of train, the runtime's timeouts in one section
    **{f"rollout.{k}": f"sampling.{k}" for k in ("max_new_tokens", "temperature", "top_p", "top_k", "seed",
                                                 "ignore_eos")},
    "rollout.sglang_launcher": "sglang.launcher", "rollout.mem_fraction": "sglang.mem_fraction",
    "rollout.tp_size": "sglang.tp_size",
    **{f"reward.{k}": f"reward_model.{k}" for k in ("weight", "chat_template", "batch_size", "dtype", "device",
                                                    "timeout_s")},
    "reward.model_path": "reward_model.path",
    "task.reward": "reward.functions", "task.reward_weights": "reward.weights",
    "task.reward_timeout_s": "reward.async_timeout_s", "task.format_regex": "reward.format_regex",
    "train.parallel": "parallel.layout", "train.tp_size": "parallel.tp_size",
    "train.fsdp_reshard_after_forward": "parallel.fsdp_reshard_after_forward",
    **{f"runtime.{k}_timeout_s": f"timeouts.{k}_s" for k in ("rpc", "rollout", "event", "lease", "cleanup", "drain",
                                                             "startup")},
    "runtime.scheduler_lease_s": "timeouts.scheduler_lease_s",
}
log = logging.getLogger("rlhf.config")


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """The docstring literal under each field of a dataclass (read from its source once: every command reads them
    twice, for --help's text and the boolean flags)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # source not available (frozen app): fall back to no docs
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


LIST_STRINGS = ("reward.functions", "reward.weights")  # comma-separated strings that YAML may give as lists


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _resolved_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(key: str, raw: Any, tp: Any) -> Any:
    """Convert a YAML or command-line value to the field's declared type."""
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected a boolean (true/false), got {raw!r}")
    if tp in (int, float):
        if isinstance(raw, bool):
            raise ConfigError(f"{key}: expected {tp.__name__}, got boolean {raw!r}")
        try:
            if tp is int and isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return tp(raw) if not (tp is int and isinstance(raw, str)) else int(raw, 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected {tp.__name__}, got {raw!r}") from None
    if tp is list:
        if not isinstance(raw, list):
            raise ConfigError(f"{key}: expected a list, got {type(raw).__name__}")
        return list(raw)
    if tp is str:
        if isinstance(raw, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {type(raw).__name__}")
        return str(raw)
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


def _merge(cls: type, base: Any, updates: dict[str, Any], prefix: str = "") -> Any:
    """A new instance of `cls` from `base` with `updates` (nested dicts) applied and validated."""
    if not isinstance(updates, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {updates!r}")
    types = _resolved_types(cls)
    kwargs: dict[str, Any] = {}
    if "preset" in updates and hasattr(cls, "from_preset"):  # a preset resets the section; its other keys follow
        base = cls.from_preset(_convert(prefix + "preset", updates["preset"], str))
    for f in dataclasses.fields(cls):
        kwargs[f.name] = getattr(base, f.name)
    for key, value in updates.items():
        full = prefix + str(key)
        if key not in types:
            valid = [f.name for f in dataclasses.fields(cls)]
            hint = difflib.get_close_matches(str(key), valid, n=1)
            extra = f" (did you mean '{prefix}{hint[0]}'?)" if hint else ""
            raise ConfigError(f"unknown config key {full!r}{extra}; valid keys here: {', '.join(valid)}")
        tp = types[key]
        if full in LIST_STRINGS and isinstance(value, list):  # the YAML list form of a comma-separated value
            value = ",".join(str(v) for v in value)
        if _is_section(tp):
            kwargs[key] = _merge(tp, kwargs[key], value, prefix=full + ".")
        else:
            kwargs[key] = _convert(full, value, tp)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        # Sections report their own dotted keys; keep them.
        raise err


def apply_overrides(cfg: Config, updates: dict[str, Any]) -> Config:
    """Return a validated copy of `cfg` with nested `updates` applied (old keys read in their new places)."""
    return _merge(Config, cfg, moved_to_their_places(updates) if isinstance(updates, dict) else updates)


def moved_to_their_places(updates: dict[str, Any]) -> dict[str, Any]:
    """A copy of nested `updates` with every key of MOVED_KEYS under its new name, each with one deprecation line;
    the old and the new name both given is an error."""
    out = copy.deepcopy(updates)
    for old, new in MOVED_KEYS.items():
        *path, leaf = old.split(".")
        node: Any = out
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node.pop(leaf)
        *new_path, new_leaf = new.split(".")
        target = out
        for part in new_path:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{new}: {part!r} is a value, not a section")
        if new_leaf in target:
            raise ConfigError(f"config key {old!r} has moved to {new!r}, and both are given: keep {new}")
        target[new_leaf] = value
        log.warning("config key %s has moved to %s: read as %s %s (the old name will go)", old, new, new, value)
    return out


def dotted_to_nested(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """[('rollout.group_size', '8')] -> {'rollout': {'group_size': '8'}}."""
    nested: dict[str, Any] = {}
    for key, value in pairs:
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part!r} is a value, not a section")
        node[parts[-1]] = value
    return nested


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML config file; syntax errors name the file and line."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config: file not found: {path}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise ConfigError(f"{where}: YAML syntax error: {getattr(err, 'problem', err)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _bool_fields() -> set[str]:
    out = set()
    for key, tp, _doc, _default in iter_fields():
        if tp is bool:
            out.add(key)
    return out


def iter_fields(cls: type = Config, base: Any = None, prefix: str = ""):
    """Yield (dotted key, type, doc, default) for every leaf field of the config tree."""
    base = base if base is not None else cls()
    types = _resolved_types(cls)
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = types[f.name]
        value = getattr(base, f.name)
        if _is_section(tp):
            yield from iter_fields(tp, value, prefix + f.name + ".")
        else:
            yield prefix + f.name, tp, docs.get(f.name, ""), value


def format_help(cfg: Config | None = None) -> str:
    """All config keys with type, default and doc, grouped by section, for --help."""
    cfg = cfg or Config()
    lines = []
    section = None
    for key, tp, doc, default in iter_fields(Config, cfg):
        if tp is list:
            continue  # faults: set with --faults FILE (YAML), not a dotted flag
        head = key.split(".")[0] if "." in key else ""
        if head != section:
            section = head
            lines.append(f"\n  [{head or 'run'}]")
        flag = key if "." in key else key.replace("_", "-")  # top-level keys are argparse flags: --run-dir
        lines.append(f"  --{flag} {tp.__name__.upper():5s} (default: {default!r})")
        if doc:
            lines.append(f"        {doc}")
    return "\n".join(lines)


def format_reference() -> str:
    """The configuration reference in Markdown (docs/configuration.md): a table a section, each key with its type,
    default and doc, from the dataclasses' field docstrings (`rlhf config --reference` prints it)."""
    out: list[str] = []
    section = None
    for key, tp, doc, default in iter_fields(Config, Config()):
        if tp is list:
            continue
        head = key.split(".")[0] if "." in key else "run"
        if head != section:
            section = head
            out += ["", f"### {head}", "", "| key | type | default | what it is |", "|---|---|---|---|"]
        flag = key if "." in key else key.replace("_", "-")
        text = doc.replace("|", "\\|").replace("<", "&lt;")
        out.append(f"| `--{flag}` | {tp.__name__} | `{default!r}` | {text} |")
    return "\n".join(out[1:]) + "\n"


def parse_overrides(argv: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Split argv into dotted (key, value) pairs and everything else.

    `--a.b value`, `--a.b=value` and, for boolean fields, a bare `--a.b` (meaning true).
    Non-dotted top-level keys of Config (`--seed`, `--steps`) are handled by the caller.
    """
    bools = _bool_fields()
    pairs: list[tuple[str, str]] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            key, eq, value = arg[2:].partition("=")
            key = key.replace("-", "_")  # --sft.eval-every and --sft.eval_every are the same key
            if not eq:
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                if key in bools and (nxt is None or nxt.startswith("--")):
                    value = "true"
                elif nxt is None:
                    raise ConfigError(f"--{key}: missing value")
                else:
                    value = nxt
                    i += 1
            pairs.append((key, value))
        else:
            rest.append(arg)
        i += 1
    return pairs, rest


def build_config(
    preset: str = "default",
    config_file: str | None = None,
    dotted: list[tuple[str, Any]] | None = None,
    top_level: dict[str, Any] | None = None,
    scenario: list[tuple[str, Any]] | None = None,
) -> Config:
    """Preset → YAML file → a fault file's `config:` (scenario) → top-level flags (--seed, --steps, --run-dir)
    → dotted overrides."""
    _choice("--preset", preset, PRESETS)
    cfg = PRESETS[preset]()
    if config_file:
        try:
            cfg = apply_overrides(cfg, load_yaml(config_file))
        except ConfigError as err:
            raise ConfigError(f"{config_file}: {err}") from None
    if scenario:
        try:
            cfg = apply_overrides(cfg, dotted_to_nested(scenario))
        except ConfigError as err:
            raise ConfigError(f"fault file config: {err}") from None
    if top_level:
        cfg = apply_overrides(cfg, {k: v for k, v in top_level.items() if v is not None})
    if dotted:
        cfg = apply_overrides(cfg, dotted_to_nested(dotted))
    return cfg
