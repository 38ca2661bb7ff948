"""CUDA graphs: one decode step captured per call shape and replayed every step."""

from __future__ import annotations

from typing import Any

import torch


class CudaGraphs:
    """Capture of a decode step (a part of RolloutEngine)."""

    def _capture(self, state: dict[str, Any]) -> Any:
        """Capture one decode step of this call's shapes as a CUDA graph; returns a replay function.

        Inputs live in static buffers (tokens, positions, the slot index); the cache write uses the slot
        as a device tensor and the attention covers every slot with future ones masked by `bias`, so one
        graph serves every step. Sampling stays outside (the engine's generator).
        """
        B = state["B"]
        buf_tokens = torch.zeros(B, dtype=torch.long, device=self.device)
        buf_pos = torch.zeros(B, dtype=torch.long, device=self.device)
        buf_t = torch.zeros(1, dtype=torch.long, device=self.device)
        side, main = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside capture (allocator, lazy init); slot 0 is rewritten at t=0
                self._decode_step(buf_tokens, buf_pos, buf_t, None, state)
            torch.cuda.synchronize(self.device)
            # capture_begin/end rather than torch.cuda.graph, which also empties the allocator's and the pinned
            # host cache at every capture (and in some torch versions runs gc.collect): on an H200 with the 110 M
            # model at 512 x 128 a call's capture took 17-22 ms this way against 20-26 ms
            graph.capture_begin()
            try:
                out = self._decode_step(buf_tokens, buf_pos, buf_t, None, state)
            finally:
                graph.capture_end()
        main.wait_stream(side)

        def replay(tokens: torch.Tensor, positions: torch.Tensor, t: int) -> torch.Tensor:
            buf_tokens.copy_(tokens)
            buf_pos.copy_(positions)
            buf_t.fill_(t)
            graph.replay()
            return out

        return replay
