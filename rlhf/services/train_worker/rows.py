"""rollout.data_plane store, a train rank's side (a part of the train worker and of a simulated rank): the
controller sends row ids, not tokens; the rank fetches its share from the rollout servers that hold it
(rlhf.batch.client), builds its train tensors and keeps them from the reference pass to the train step, the
logprobs of that pass included (they never travel back to the controller).

    /compute_logprobs, /train_step  args {"fetch": {"ids", "at", "urls", "servers"}, "step", ...} + tensors
                                    {"advantages", "mini_batch"}
    /train_step                     args {"kept": true, "step"}: the rows, columns and logprobs kept this step
"""

from __future__ import annotations

import threading

import torch

from rlhf.batch.client import RowFetcher
from rlhf.data import rl_batch
from rlhf.models import pad_token_id
from rlhf.transport.client import LoopThread


class KeptRows:
    _kept: tuple[int, list[int], dict[str, torch.Tensor]] | None = None  # (step, row ids, the train tensors)
    _fetcher: RowFetcher | None = None
    _fetcher_lock = threading.Lock()

    def row_fetcher(self) -> RowFetcher:
        """This rank's fetcher (a loop thread and a connection per rollout server, kept for the run)."""
        with self._fetcher_lock:
            if self._fetcher is None:
                self._fetcher = RowFetcher(self.token, LoopThread(f"rows-{self.rank}"), self.cfg.timeouts.rpc_s,
                                           self.cfg.resilience)
            return self._fetcher

    def rows_batch(self, args: dict, tensors: dict, stage: str, step: int) -> dict[str, torch.Tensor]:
        """The call's train tensors: those sent (rollout.data_plane controller), or the rows of args["fetch"]
        fetched (once a step: the train step finds them kept) with the sent columns (advantages, mini_batch)."""
        if args.get("kept"):  # the reference pass fetched them this step, with the columns sent then
            if self._kept is None or self._kept[0] != step:
                raise RuntimeError(f"train-{self.rank}: told to train on the rows it kept for step {step}, but it "
                                   f"keeps {'none' if self._kept is None else 'step %d' % self._kept[0]}'s "
                                   "(rollout.data_plane store: /compute_logprobs fetches them first)")
            return self._kept[2]
        where = args.get("fetch")
        if where is None:
            return tensors
        ids = [int(i) for i in where["ids"]]
        kept = self._kept
        if kept is None or kept[0] != step or kept[1] != ids:
            rows = self.row_fetcher().fetch(where, stage, step)
            batch = rl_batch([p for p, _, _ in rows], [o for _, o, _ in rows], [lp for _, _, lp in rows],
                             pad_token_id(None, self.tokenizer))
            kept = self._kept = (step, ids, batch)
        kept[2].update(tensors)
        return kept[2]

    def keep_logprobs(self, batch: dict[str, torch.Tensor], outs: dict[str, torch.Tensor],
                      keep_rollout: bool) -> dict[str, float]:
        """A logprob pass's results stay in the kept batch, where the controller would have put them (reference:
        ref_logprobs; policy: old_logprobs, the rollout's kept as rollout_logprobs when keep_rollout, the importance
        weight's); returns the rollout/recomputed difference as sums (merge_train_metrics' lp_diff_*)."""
        reply: dict[str, float] = {}
        if "policy" in outs:
            mask = batch["response_mask"]
            diff = (outs["policy"].float() - batch["old_logprobs"].float()).abs() * mask
            reply = {"lp_diff_sum": float(diff.sum()), "lp_diff_max": float(diff.max()) if diff.numel() else 0.0,
                     "lp_diff_tokens": float(mask.sum())}
            if keep_rollout:
                batch["rollout_logprobs"] = batch["old_logprobs"]
            batch["old_logprobs"] = outs["policy"]
        if "reference" in outs:
            batch["ref_logprobs"] = outs["reference"]
        return reply

    def drop_rows(self) -> None:
        """After the train step: the kept batch is not needed again."""
        self._kept = None
