"""A train rank's side of the data plane (rollout.data_plane store): its share's rows fetched by id from the rollout
servers that hold them, one POST /rows per server, and put back in the share's order.

    fetcher = RowFetcher(token, loop, timeout_s, policy)
    rows = fetcher.fetch({"ids": [...], "at": [index in urls of each], "urls": [...], "servers": [their numbers]},
                         stage="reference", step=3)
    # [(prompt_ids, output_ids, logprobs)] in the order of ids

The controller never sees these tokens: it sent the rank row ids (rlhf.batch.store).
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlhf import tracing
from rlhf.batch.store import Row, decode
from rlhf.config.resilience import HARDENED, Policy
from rlhf.transport.client import Client, LoopThread


class RowsMissing(LookupError):
    """A rollout server no longer holds rows the controller placed there (it was started again, or they aged out)."""


class RowFetcher:
    """window_s > 0 (the ranks of one host share a fetcher): the fetches that start within window_s of each other
    go to each server as one POST /rows, and each rank takes its own rows from it (a host's data loader)."""

    def __init__(self, token: str, loop: LoopThread, timeout_s: float = 600.0, policy: Policy = HARDENED,
                 window_s: float = 0.0) -> None:
        self.token, self.loop, self.timeout_s, self.policy, self.window_s = token, loop, timeout_s, policy, window_s
        self.clients: dict[str, Client] = {}  # one connection pool per store, kept from step to step
        self.batches: dict[tuple[str, int], tuple[list[int], asyncio.Future]] = {}  # (url, step) -> the window's

    def _client(self, url: str, name: str) -> Client:
        if url not in self.clients:
            self.clients[url] = Client(url, self.token, self.timeout_s, peer=name,
                                       retries=self.policy.retry_idempotent)
        return self.clients[url]

    def fetch(self, where: dict[str, Any], stage: str = "", step: int = -1) -> list[Row]:
        """The rows of `where` ({"ids", "at": each id's index in "urls", "urls", "servers": each URL's rollout server
        number}) in the order of ids."""
        ids, at, urls = [int(i) for i in where["ids"]], [int(a) for a in where["at"]], list(where["urls"])
        names = [f"rollout-{s}" for s in where.get("servers") or range(len(urls))]  # each URL's server, for errors
        by_server: dict[int, list[int]] = {}
        for i, a in zip(ids, at):
            by_server.setdefault(a, []).append(i)

        async def one(server: int, wanted: list[int]) -> dict[int, Row]:
            if not self.window_s:
                return await self._get(urls[server], names[server], wanted, stage, step)
            key, loop = (urls[server], step), asyncio.get_running_loop()
            if key not in self.batches:  # the first fetch of the window: the others join it, then it is sent
                self.batches[key] = ([], loop.create_future())
                loop.call_later(self.window_s, lambda: asyncio.ensure_future(
                    self._send(key, names[server], stage, step)))
            self.batches[key][0].extend(wanted)
            found = await asyncio.shield(self.batches[key][1])
            return {i: found[i] for i in wanted}

        with tracing.span("batch.fetch", stage=stage, step=step, **{"rlhf.rows": len(ids),
                                                                    "rlhf.servers": len(by_server)}):
            async def every() -> list[dict[int, Row]]:
                return list(await asyncio.gather(*[one(s, w) for s, w in by_server.items()]))

            found: dict[int, Row] = {}
            for part in self.loop.run_as_caller(every()):
                found.update(part)
        return [found[i] for i in ids]

    async def _get(self, url: str, name: str, wanted: list[int], stage: str, step: int) -> dict[int, Row]:
        header, tensors = await self._client(url, name).call("/rows", {"ids": wanted}, stage=stage, step=step,
                                                             traced=False)
        if header["missing"]:
            raise RowsMissing(f"{name} ({url}) no longer holds rows {header['missing'][:8]}"
                              f"{' …' if len(header['missing']) > 8 else ''} of step {step} (it was started "
                              "again after generating them, or they aged out of its store)")
        return dict(zip(wanted, decode(tensors)))

    async def _send(self, key: tuple[str, int], name: str, stage: str, step: int) -> None:
        wanted, future = self.batches.pop(key)
        try:
            future.set_result(await self._get(key[0], name, sorted(set(wanted)), stage, step))
        except Exception as exc:  # noqa: BLE001 — each rank of the window raises it
            future.set_exception(exc)

    def close(self) -> None:
        for client in self.clients.values():
            self.loop.run(client.close())
        self.clients.clear()
