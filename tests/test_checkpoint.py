"""Parity checkpoints: rank files with checksums, atomic slots, the newest valid slot, exact reload."""

import json
import os

import torch

from rlhf.checkpoint import slots as ckpt


def _model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _save(checkpoints, slot, step, atomic, model, opt):
    staging = os.path.join(checkpoints, f".staging-{slot}") if atomic else os.path.join(checkpoints, slot)
    files = ckpt.write_rank_files(staging, 0, model, opt, fsync=False)
    return ckpt.finish_slot(checkpoints, slot, staging, {"step": step, "complete": True, "files": files}, atomic)


def test_saved_slot_reloads_model_optimizer_and_rng_exactly(tmp_path):
    model, opt = _model_and_optimizer(0)
    torch.manual_seed(123)
    path = _save(str(tmp_path), "latest_odd", 1, True, model, opt)
    expected_draw = torch.rand(3)
    other, other_opt = _model_and_optimizer(1)
    ckpt.load_rank_files(path, 0, other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], other_opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where the saved run was


def test_newest_valid_slot_wins_and_a_corrupt_one_is_skipped_only_with_checksums(tmp_path):
    model, opt = _model_and_optimizer(0)
    checkpoints = str(tmp_path)
    _save(checkpoints, "latest_odd", 3, True, model, opt)
    newer = _save(checkpoints, "latest_even", 4, True, model, opt)
    assert ckpt.newest_checkpoint(checkpoints)[1]["step"] == 4
    with open(os.path.join(newer, "model.safetensors"), "r+b") as fh:  # a torn write in the newer slot
        fh.seek(-4, os.SEEK_END)
        fh.write(b"\0\0\0\1")
    assert ckpt.newest_checkpoint(checkpoints, check_sums=True)[1]["step"] == 3
    assert ckpt.newest_checkpoint(checkpoints, check_sums=False)[1]["step"] == 4  # without sums it is trusted


def test_a_slot_without_meta_json_is_not_a_checkpoint(tmp_path):
    model, opt = _model_and_optimizer(0)
    ckpt.write_rank_files(str(tmp_path / "latest_odd"), 0, model, opt, fsync=False)  # files, no meta.json yet
    assert ckpt.newest_checkpoint(str(tmp_path)) is None
    (tmp_path / "latest_odd" / ckpt.META).write_text(json.dumps({"step": 1, "complete": False}))
    assert ckpt.newest_checkpoint(str(tmp_path)) is None


def test_atomic_slot_replaces_the_old_one_whole_and_leaves_no_staging(tmp_path):
    model, opt = _model_and_optimizer(0)
    _save(str(tmp_path), "latest_odd", 1, True, model, opt)
    _save(str(tmp_path), "latest_odd", 3, True, model, opt)
    ckpt.wait_removals()  # the replaced slot is removed beside the run (the process waits for it at exit)
    assert sorted(os.listdir(tmp_path)) == ["latest_odd"]
    assert json.loads((tmp_path / "latest_odd" / ckpt.META).read_text())["step"] == 3
    assert ckpt.slot_for_step(3) == "latest_odd" and ckpt.slot_for_step(4) == "latest_even"


def test_a_replaced_slot_is_removed_by_its_ranks_then_what_is_left_by_the_caller(tmp_path):
    """A big world's slot is a file per rank: each rank removes its own files of the slot the last save replaced
    (OwnFiles), the controller only meta.json and the folder; a file no rank knows (after a restart) goes too."""
    model, opt = _model_and_optimizer(0)
    checkpoints, replaced = str(tmp_path), {}
    ranks = {r: ckpt.OwnFiles() for r in range(3)}

    def save(step):
        slot = ckpt.slot_for_step(step)
        staging = os.path.join(checkpoints, f".staging-{slot}")
        gone = {r: own.remove(dict(replaced)) for r, own in ranks.items()}
        files = {}
        for r, own in ranks.items():
            written = ckpt.write_rank_files(staging, r, model if r == 0 else None, opt, fsync=False)
            own.wrote(slot, written)
            files.update(written)
        old = dict(replaced)
        replaced.clear()
        ckpt.finish_slot(checkpoints, slot, staging, {"step": step, "complete": True, "files": files}, True,
                         replaced=replaced)
        return gone, old

    save(1)
    save(2)
    (tmp_path / "latest_odd" / "left-by-a-rank-before-a-restart.json").write_text("{}")
    gone, old = save(3)
    assert gone == {0: 0, 1: 0, 2: 0} and list(replaced) == ["latest_odd"]
    folder = replaced["latest_odd"]
    assert ".old-" in folder and len(os.listdir(folder)) == 11  # 2 files a rank, rank 0 3 more, meta, the stray
    gone, old = save(4)  # the ranks remove their files of step 1's slot, then the caller the rest
    assert gone == {0: 5, 1: 2, 2: 2}
    assert sorted(os.listdir(folder)) == ["left-by-a-rank-before-a-restart.json", ckpt.META]
    for path in old.values():
        ckpt.remove_later(path)
    ckpt.wait_removals()
    assert sorted(os.listdir(tmp_path)) == sorted(["latest_odd", "latest_even", os.path.basename(replaced["latest_even"])])
    assert ckpt.newest_checkpoint(checkpoints)[1]["step"] == 4
    # a run killed before its next save leaves that one: the next run's start removes it
    assert ckpt.remove_stale_replaced(checkpoints) == [replaced["latest_even"]]
    ckpt.wait_removals()
    assert sorted(os.listdir(tmp_path)) == ["latest_even", "latest_odd"]


def test_a_bounded_write_abandons_a_stuck_writer_and_waits_for_a_working_one(tmp_path):
    """abandon_stuck_saves: a writer blocked half-way through a file (a real blocked thread: the hang fault) is given
    up after stall_s with what it left on disk; an unobstructed write returns the same files as write_items."""
    import textwrap
    import threading
    import time

    import pytest

    from rlhf import faults
    from rlhf.errors import CheckpointWriteStalled
    from rlhf.faults.parse import parse_faults_text

    model, opt = _model_and_optimizer(0)
    items = ckpt.snapshot_rank_files(0, model, opt)
    files = ckpt.write_bounded(str(tmp_path / "ok"), items, False, 1.0, "train-0")
    assert files == ckpt.write_items(str(tmp_path / "plain"), items, False)
    os.makedirs(tmp_path / "faults")
    faults.arm(str(tmp_path), parse_faults_text(textwrap.dedent("""
        faults:
          - name: stuck
            kind: hang
            point: checkpoint.write
            when: {max_hits: 1}
    """), "test.yaml"))
    try:
        t0 = time.monotonic()
        with pytest.raises(CheckpointWriteStalled) as err:
            ckpt.write_bounded(str(tmp_path / "stuck"), items, False, 0.5, "train-0")
        assert 0.5 <= time.monotonic() - t0 < 5
        half = os.path.getsize(tmp_path / "stuck" / "model.safetensors")
        assert f"model.safetensors {half} B" in str(err.value) and "no progress for 0.5 s" in str(err.value)
        assert any(t.name == "ckpt-write-train-0" for t in threading.enumerate())  # left behind, still blocked
    finally:
        faults.disarm()  # releases the hang: the abandoned thread finishes in its own folder
