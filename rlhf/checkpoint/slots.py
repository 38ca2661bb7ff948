"""Parity checkpoints: latest_recover_save into alternating latest_odd / latest_even slots, and
periodic_recover_save into periodic/step_<N>. Everything is safetensors + JSON (no pickle).

A slot holds model.safetensors, optimizer.safetensors + optimizer.json, rng-rank<r>.safetensors +
rng-rank<r>.json, and meta.json (step, controller state, sha256 of every file) written last.
`hardened` writes into a temporary folder, fsyncs, and renames it into place, so a slot is
either the old one or the new one; `faithful` writes the files in place, as the seeds' system
did, so a crash or a full disk mid-save leaves a partial slot that is only noticed when read.
Resume takes the newest slot whose meta.json is complete and whose checksums verify, falling
back to the other slot.
"""

from __future__ import annotations

import atexit
import contextvars
import errno
import glob
import hashlib
import json
import os
import random
import shutil
import threading
import time
from typing import Any

import torch
from safetensors.torch import load_file
from safetensors.torch import save as to_bytes

from rlhf import tracing
from rlhf.checkpoint import sharded as sharded_checkpoint
from rlhf.errors import CheckpointWriteStalled
from rlhf.faults import fault_point
from rlhf.tracing.metrics import thread_activity
from rlhf.train.parallel import is_dtensor
from rlhf.weights import copy_whole_, export_state, import_state

META = "meta.json"


def slot_for_step(step: int) -> str:
    return "latest_odd" if step % 2 else "latest_even"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """AdamW state as named tensors + JSON (param groups, scalar state)."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, st in state["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{idx}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    for name, value in meta["scalars"].items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    py = random.getstate()
    return {"torch": torch.get_rng_state()}, {"python": [py[0], list(py[1]), py[2]]}


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    v, internal, gauss = meta["python"]
    random.setstate((v, tuple(internal), gauss))


def snapshot_rank_files(rank: int, model: torch.nn.Module | None, optimizer: Any,
                        copy: bool = False, sharded: bool = False) -> list[tuple[str, Any]]:
    """This rank's checkpoint files as (name, tensors or JSON data). copy: detach them from the live model and
    optimizer (a background write must not see the next step's updates); a synchronous write needs no copy.
    sharded: the model is laid out in pieces (rlhf.checkpoint.sharded): every rank writes its own."""
    items: list[tuple[str, Any]] = []
    own = (lambda t: t.clone()) if copy else (lambda t: t)
    if sharded and model is not None:
        items += sharded_checkpoint.snapshot(rank, model, optimizer, copy)
    elif rank == 0 and model is not None:
        items.append(("model.safetensors", {k: own(v.detach().contiguous().cpu()) for k, v in export_state(model).items()}))
        opt_tensors, opt_meta = optimizer_tensors(optimizer)
        items.append(("optimizer.safetensors", {k: own(v) for k, v in opt_tensors.items()} or {"empty": torch.zeros(0)}))
        items.append(("optimizer.json", opt_meta))
    rng_tensors, rng_meta = rng_state()
    items.append((f"rng-rank{rank}.safetensors", rng_tensors))
    items.append((f"rng-rank{rank}.json", rng_meta))
    return items


def write_rank_files(directory: str, rank: int, model: torch.nn.Module | None, optimizer: Any, fsync: bool,
                     write_hook: Any = None, sharded: bool = False) -> dict[str, str]:
    """Write this rank's files into `directory`; rank 0 also writes model and optimizer (sharded: every rank its
    pieces). Returns sha256 by file."""
    return write_items(directory, snapshot_rank_files(rank, model, optimizer, sharded=sharded), fsync, write_hook)


def write_items(directory: str, items: list[tuple[str, Any]], fsync: bool, write_hook: Any = None) -> dict[str, str]:
    """Write snapshot items in place. The checkpoint.write point sits half-way through each tensor file."""

    os.makedirs(directory, exist_ok=True)
    written: dict[str, str] = {}

    def put_tensors(name: str, tensors: dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], dict[str, str]]
                    ) -> None:
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)  # shards/ of a sharded slot
        if write_hook is not None:
            write_hook(path)
        tensors, metadata = tensors if isinstance(tensors, tuple) else (tensors, None)
        data = to_bytes(tensors, metadata=metadata)
        half = len(data) // 2
        with tracing.span("checkpoint.write", file=name, bytes=len(data)), open(path, "wb") as fh:
            fh.write(data[:half])
            fh.flush()  # half of the file is in the file system when the point runs (an IO hang stops here)
            directives = fault_point("checkpoint.write", path=path, written=half, size=len(data))
            fh.write(data[half:])
        for d in directives:  # an emulated full disk: the file ends part way and the write fails
            if d and d.get("truncate_at"):
                size = os.path.getsize(path)
                os.truncate(path, int(size * float(d["truncate_at"])))
                raise OSError(errno.ENOSPC, f"No space left on device (wrote {int(size * d['truncate_at'])} of {size} "
                                            "bytes) [disk_full, emulated]", path)
        if fsync:
            fault_point("checkpoint.fsync", path=path)
            with tracing.span("checkpoint.fsync", file=name):
                _fsync_file(path)
        written[name] = _sha256(path)

    def put_json(name: str, data: Any) -> None:
        path = os.path.join(directory, name)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        written[name] = _sha256(path)

    for name, data in items:
        (put_tensors if name.endswith(".safetensors") else put_json)(name, data)
    return written


def write_bounded(directory: str, items: list[tuple[str, Any]], fsync: bool, stall_s: float, who: str) -> dict[str, str]:
    """write_items on a thread of its own (resilience.abandon_stuck_saves). When that thread has neither used CPU nor
    waited on the disk for stall_s, give up on it: it stays behind (a daemon), and CheckpointWriteStalled says what it
    left on disk. A slow write that progresses (serialising, writing, fsync, checksums) is waited for."""
    done: dict[str, Any] = {}
    started = threading.Event()
    ctx = contextvars.copy_context()

    def write() -> None:
        done["tid"] = threading.get_native_id()
        started.set()
        try:
            done["files"] = write_items(directory, items, fsync)
        except BaseException as exc:  # handed to the caller below, which raises it
            done["error"] = exc

    thread = threading.Thread(target=ctx.run, args=(write,), name=f"ckpt-write-{who}", daemon=True)
    thread.start()
    started.wait()
    last, since = thread_activity(done["tid"])[1], time.monotonic()
    while True:
        thread.join(0.1)  # the write's end, or a look at its progress every 0.1 s
        if not thread.is_alive():
            break
        state, cpu = thread_activity(done["tid"])
        if cpu != last or state in ("R", "D"):
            last, since = cpu, time.monotonic()
        elif time.monotonic() - since >= stall_s:
            on_disk = {e.name: e.stat().st_size for e in os.scandir(directory) if e.is_file()}
            raise CheckpointWriteStalled(
                f"{who}: checkpoint write to {directory} made no progress for {stall_s:g} s (writer thread state "
                f"{state}: no CPU, no disk wait; on disk: "
                + (", ".join(f"{k} {v} B" for k, v in sorted(on_disk.items())) or "nothing") + "); abandoned")
    if "error" in done:
        raise done["error"]
    return done["files"]


def finish_slot(checkpoints: str, slot: str, staging: str, meta: dict[str, Any], atomic: bool,
                replaced: dict[str, str] | None = None) -> str:
    """Write meta.json (last) and, when atomic, move the staging folder into place. The slot it replaces is removed
    beside the run (remove_later), or, given `replaced`, kept there under its slot's name: the ranks remove their own
    files of it at the next save (OwnFiles), and the caller what is left."""
    with open(os.path.join(staging, META), "w", encoding="utf-8") as fh:
        json.dump(meta, fh)
        fh.flush()
        os.fsync(fh.fileno())
    final = os.path.join(checkpoints, slot)
    if atomic and staging != final:
        old = f"{final}.old-{time.monotonic_ns()}"
        if os.path.exists(final):
            os.replace(final, old)
        os.makedirs(os.path.dirname(final), exist_ok=True)  # periodic/step_N: the first one makes periodic/
        os.replace(staging, final)
        if replaced is None:
            remove_later(old)
        elif os.path.exists(old):
            replaced[slot] = old
    return final


class OwnFiles:
    """The files one rank wrote into each slot (by the slot's name), so that the rank removes its own part of a
    replaced slot: a big world's slot is a file per rank, and removing a thousand files is the ranks' work (each
    host its own), not the controller's. The controller removes what is left (meta.json, the folder; everything,
    after a restart, when the ranks no longer know their files)."""

    def __init__(self) -> None:
        self.by_slot: dict[str, list[str]] = {}

    def wrote(self, slot: str | None, names: Any) -> None:
        if slot:
            self.by_slot[slot] = list(names)

    def remove(self, replaced: dict[str, str] | None) -> int:
        """Unlink this rank's files in each replaced slot's folder ({slot name: folder}); the number removed."""
        removed = 0
        for slot, folder in (replaced or {}).items():
            for name in self.by_slot.get(slot, ()):
                try:
                    os.unlink(os.path.join(folder, name))
                    removed += 1
                except FileNotFoundError:
                    pass
        return removed


_removing: list[threading.Thread] = []


def remove_later(*paths: str) -> None:
    """Replaced slots are removed beside the run, not in the step: the new one is in place already, and a big
    world's slot (a file per rank) takes a while to remove (~0.5 s a save at 1,024 ranks). The process waits for the
    removals before it exits (wait_removals)."""
    for path in paths:
        if not os.path.exists(path):
            continue
        thread = threading.Thread(target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                                  name="slot-remove", daemon=True)
        thread.start()
        _removing.append(thread)
    _removing[:] = [t for t in _removing if t.is_alive()]


def remove_stale_replaced(checkpoints: str) -> list[str]:
    """Replaced slots a run left behind when it was killed before its next save (`<slot>.old-N`): none is a
    checkpoint (newest_checkpoint never reads them); removed beside the run."""
    stale = sorted(glob.glob(os.path.join(checkpoints, "*.old-*")) + glob.glob(os.path.join(checkpoints, "*", "*.old-*")))
    remove_later(*stale)
    return stale


def wait_removals(timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    for thread in list(_removing):
        thread.join(max(0.0, deadline - time.monotonic()))
    _removing[:] = [t for t in _removing if t.is_alive()]


atexit.register(wait_removals)


def verify_slot(path: str, check_sums: bool) -> dict[str, Any] | None:
    """meta.json of a complete slot (with files matching their checksums when asked), else None."""
    try:
        with open(os.path.join(path, META), encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return None
    if not meta.get("complete"):
        return None
    if check_sums:
        for name, digest in meta.get("files", {}).items():
            file = os.path.join(path, name)
            if not os.path.exists(file) or _sha256(file) != digest:
                return None
    return meta


def newest_checkpoint(checkpoints: str, check_sums: bool = True) -> tuple[str, dict[str, Any]] | None:
    """The newest valid checkpoint among latest_odd, latest_even and periodic/step_*."""
    candidates = [os.path.join(checkpoints, s) for s in ("latest_odd", "latest_even")]
    candidates += glob.glob(os.path.join(checkpoints, "periodic", "step_*"))
    best: tuple[str, dict[str, Any]] | None = None
    for path in candidates:
        meta = verify_slot(path, check_sums)
        if meta is not None and (best is None or meta["step"] > best[1]["step"]):
            best = (path, meta)
    return best


def load_rank_files(path: str, rank: int, model: torch.nn.Module, optimizer: Any) -> None:
    """Model, optimizer and this rank's RNG from a slot, into the model's layout now: a sharded slot into any layout
    (resharded by torch.distributed.checkpoint), a replicated one into replicated dp or, cut into pieces, a sharded
    layout. In a sharded layout or from a sharded slot every rank of the world must call it."""
    sharded_model = any(is_dtensor(p) for p in model.parameters())
    if sharded_checkpoint.is_sharded_slot(path):
        sharded_checkpoint.load(path, model, optimizer)
    elif sharded_model:
        _replicated_into_sharded(path, model, optimizer)
    else:
        import_state(model, load_file(os.path.join(path, "model.safetensors")))
        if optimizer is not None:
            opt_tensors, opt_meta = _optimizer_files(path)
            load_optimizer(optimizer, opt_tensors, opt_meta)
    rng_file = os.path.join(path, f"rng-rank{rank}.safetensors")
    if os.path.exists(rng_file):
        with open(os.path.join(path, f"rng-rank{rank}.json"), encoding="utf-8") as fh:
            set_rng_state(load_file(rng_file), json.load(fh))


def _optimizer_files(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    with open(os.path.join(path, "optimizer.json"), encoding="utf-8") as fh:
        opt_meta = json.load(fh)
    opt_tensors = load_file(os.path.join(path, "optimizer.safetensors"))
    opt_tensors.pop("empty", None)
    return opt_tensors, opt_meta


@torch.no_grad()
def _replicated_into_sharded(path: str, model: torch.nn.Module, optimizer: Any) -> None:
    """A replicated slot (model.safetensors; AdamW state by parameter index) into a sharded layout: each rank cuts its
    pieces from the whole tensors (no communication)."""
    import_state(model, load_file(os.path.join(path, "model.safetensors")))
    if optimizer is None:
        return
    sharded_checkpoint.init_optimizer_state(optimizer)
    tensors, meta = _optimizer_files(path)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, p in enumerate(params):
        for key, target in optimizer.state[p].items():
            src = tensors.get(f"{index}.{key}")
            if src is not None and isinstance(target, torch.Tensor):
                copy_whole_(target, src)
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
