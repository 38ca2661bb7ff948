"""rollout.data_plane store, the rollout server's side (a part of RolloutServer): a /generate call that carries
`rlhf_rows` keeps its samples' tokens here and answers with metadata only; POST /rows hands a train rank its rows.

    POST /generate {..., "rlhf_rows": {"step": S, "ids": [a row id per output], "answers": [one per prompt],
                    "prompts": [one per prompt], "fields": [one per prompt]}}
         → sglang's outputs without their tokens: output_ids [], text "", meta_info {weight_version, finish_reason,
           oldest_weight_version (a sample that spans versions)}, and
           "rlhf_row": {"id", "prompt_tokens", "completion_tokens", "reward", "rewards": {label: value}}
    POST /rows {"ids": [...]} → {"rows", "missing"} + tensors prompt_lens, output_lens, prompt_ids, output_ids,
                               logprobs (rlhf.batch.store: raw buffers and a JSON header, never a pickle)

The reward functions run here, beside the rows (the run's reward section: rlhf.tasks.scoring), so the completion
text never leaves the server either.
"""

from __future__ import annotations

from typing import Any

from rlhf import tracing
from rlhf.batch.store import RowStore
from rlhf.data import completion_text
from rlhf.errors import BadRequest
from rlhf.rollout.sglang_api import output_logprobs
from rlhf.tasks.scoring import row_fields, score_parts, scorer_of


class RowRoutes:
    rows: RowStore | None = None  # set where the server is made (rollout.data_plane store); else no row is kept
    scorer: Any = None  # rlhf.tasks.scoring.Scorer of the run's reward section

    def rows_route(self, args: dict, tensors: dict) -> tuple[dict, dict]:
        if self.rows is None:
            raise BadRequest(f"rollout-{self.rank} keeps no rows (the run's rollout.data_plane is controller)")
        ids = args.get("ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise BadRequest(f"/rows needs ids: a list of row ids (integers), got {type(ids).__name__}")
        return self.rows.encode(ids)

    def check_rows(self, spec: Any, call: Any) -> None:
        """A /generate call's rlhf_rows before it runs: BadRequest naming what does not fit."""
        if self.rows is None or self.scorer is None:
            raise BadRequest(f"rollout-{self.rank} keeps no rows: rlhf_rows needs rollout.data_plane store")
        if call.stream:
            raise BadRequest("rlhf_rows: a streamed /generate cannot keep its rows (stream false)")
        if not isinstance(spec, dict):
            raise BadRequest(f"rlhf_rows must be an object, got {type(spec).__name__}")
        outputs = sum(p.sampling.n for p in call.prompts)
        for key, want in (("ids", outputs), ("answers", len(call.prompts)), ("prompts", len(call.prompts)),
                          ("fields", len(call.prompts))):
            value = spec.get(key)
            if not isinstance(value, list) or len(value) != want:
                got = len(value) if isinstance(value, list) else type(value).__name__
                raise BadRequest(f"rlhf_rows.{key}: {want} entries needed ({'one per output' if key == 'ids' else 'one per prompt'}), got {got}")
        if not isinstance(spec.get("step"), int):
            raise BadRequest("rlhf_rows.step: the step's number (an integer)")

    def keep_rows(self, call: Any, outputs: list[dict]) -> list[dict]:
        """Store each output's tokens under its row id, score them, and answer with metadata only."""
        assert self.rows is not None and self.scorer is not None
        spec, tok = call.rows, self.engine.tokenizer
        owner = [i for i, p in enumerate(call.prompts) for _ in range(p.sampling.n)]
        with tracing.span("rows.keep", step=spec["step"], **{"rlhf.rows": len(outputs)}):
            for k, out in enumerate(outputs):
                self.rows.put(spec["step"], spec["ids"][k], call.prompts[owner[k]].ids, out["output_ids"],
                              output_logprobs(out))
            total, parts = score_parts(self.scorer.rewards, [completion_text(tok, o) for o in outputs],
                                       [spec["answers"][i] for i in owner], [spec["prompts"][i] for i in owner],
                                       row_fields([spec["fields"][i] or {} for i in owner]), self.scorer.timeout_s)
        replies = []
        for k, out in enumerate(outputs):
            # the metadata the controller keeps: a big world's step has thousands of these
            meta = {key: out["meta_info"].get(key) for key in ("weight_version", "finish_reason")}
            versions = out["meta_info"].get("output_token_weight_versions")  # one a token: the oldest is what counts
            if versions:
                meta["oldest_weight_version"] = versions[0]
            replies.append({"text": "", "output_ids": [], "meta_info": meta, "rlhf_row": {
                "id": spec["ids"][k], "prompt_tokens": len(call.prompts[owner[k]].ids),
                "completion_tokens": len(out["output_ids"]), "reward": total[k],
                "rewards": {label: values[k] for label, values in parts.items()}}})
        return replies


def row_store(cfg: Any) -> RowStore | None:
    """The store a rollout host keeps (rollout.data_plane store; None otherwise): the rows of the steps a batch may
    still be trained at (async: rollout.max_staleness versions later) and one more."""
    if cfg.data_plane != "store":
        return None
    return RowStore(keep_steps=2 + (cfg.rollout.max_staleness if cfg.rollout.mode == "async" else 0))


def keep_rows_in(server: RowRoutes, cfg: Any, store: RowStore | None) -> None:
    """Make `server` keep and score its rows in `store` (shared by the servers of one host)."""
    if store is not None:
        server.rows, server.scorer = store, scorer_of(cfg.reward)
