"""Checkpoint saves as the policy says: atomic slots (staged, renamed), a failed save fatal, skipped (the newest
valid slot stays) or a WARNING; every rank writes its files, meta.json last."""

from __future__ import annotations

import logging
import os
import shutil

from rlhf.checkpoint import slots as ckpt
from rlhf.errors import HTTPStatusError, RemoteError

log = logging.getLogger("rlhf.controller")


class CheckpointSaves:
    """latest_recover_save / periodic_recover_save for a controller (a part of RunLifecycle)."""

    def checkpoint(self, slot: str, step: int, background: bool = False) -> bool:
        """Save `slot` per the policy: a failure stops the run (fatal_save_errors), is skipped keeping the newest
        valid slot (skip_failed_saves with atomic_checkpoints), or is a WARNING; False when it failed.

        background (only without fatal_save_errors, checkpoint.periodic_async): the ranks write on a writer
        thread and reply at once; meta.json is written without waiting for them (the seeds' asynchronous save).
        """
        stage = "latest_recover_save" if slot.startswith("latest") else "periodic_recover_save"
        if self.policy.skip_failed_saves and self.policy.atomic_checkpoints:
            try:
                self.save(slot, step, stage)
            except (RemoteError, HTTPStatusError, OSError) as exc:
                if isinstance(exc, (TimeoutError, ConnectionError)):
                    raise  # a rank that does not answer (a hung write) or is gone: the run cannot go on without it
                # every rank answered, one with an error (or meta.json could not be written here): the step goes on
                self.saves_failed += 1
                self.failed_in_a_row += 1
                shutil.rmtree(os.path.join(self.run_dir, "checkpoints", staging_name(slot)), ignore_errors=True)
                limit = self.cfg.checkpoint.max_failed_saves
                if self.failed_in_a_row >= limit:
                    raise
                found = ckpt.newest_checkpoint(os.path.join(self.run_dir, "checkpoints"), check_sums=False)
                newest = f"{os.path.relpath(found[0], os.path.join(self.run_dir, 'checkpoints'))} (step " \
                    f"{found[1]['step']})" if found else "none (no save has succeeded yet)"
                log.warning("step %d: %s to %s failed (%s: %s); skipped, the newest valid checkpoint stays %s "
                            "(%d failed in a row; checkpoint.max_failed_saves=%d fails the run)", step, stage, slot,
                            type(exc).__name__, str(exc)[:300], newest, self.failed_in_a_row, limit)
                return False
            self.failed_in_a_row = 0
            return True
        if self.policy.fatal_save_errors:
            self.save(slot, step, stage)
            return True
        try:
            self.save(slot, step, stage, background)
            return True
        except (RuntimeError, OSError, TimeoutError) as exc:
            self.saves_failed += 1
            log.warning("step %d: %s to %s failed (%s: %s); continuing", step, stage, slot, type(exc).__name__, exc)
            return False

    def save(self, slot: str, step: int, stage: str, background: bool = False) -> None:
        """Every rank writes its files, then meta.json last; atomic_checkpoints: in a staging folder, renamed."""
        checkpoints = os.path.join(self.run_dir, "checkpoints")
        atomic = self.policy.atomic_checkpoints
        final = os.path.join(checkpoints, slot)
        directory = os.path.join(checkpoints, staging_name(slot)) if atomic else final
        if atomic:
            shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory, exist_ok=True)
        bounded = self.policy.abandon_stuck_saves and self.policy.skip_failed_saves and atomic and not background
        replaced, self.replaced_slots = self.replaced_slots, {}
        try:  # the ranks remove their own files of the slots the last saves replaced; this process what is left
            replies = self.workers.call("save", {"directory": directory, "fsync": True, "background": background,
                                                 "stall_s": self.cfg.checkpoint.write_stall_s if bounded else 0,
                                                 "slot": slot, "remove": replaced}, step=step, stage=stage)
        finally:
            ckpt.remove_later(*replaced.values())
        files: dict[str, str] = {}
        for reply, _ in replies:
            files.update(reply["files"])
        meta = {"step": step, "complete": True, "files": files, "slot": slot, "controller": self.checkpoint_state(step)}
        ckpt.finish_slot(checkpoints, slot, directory, meta, atomic, replaced=self.replaced_slots)

    # ------------------------------------------------------------------ cleanup


def staging_name(slot: str) -> str:
    """The folder an atomic save writes `slot` into before it is renamed into place."""
    return f".staging-{slot.replace(os.sep, '-')}"
