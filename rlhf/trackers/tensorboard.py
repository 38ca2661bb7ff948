"""TensorBoard (`--logger tensorboard`): torch.utils.tensorboard's SummaryWriter at <run-dir>/tensorboard.

Scalars by their grouped names at each step; the config as text at step 0; events as text summaries at their step
(tag events/<kind>, so a reward curve that bends at step 3 has the fault that bent it at step 3); the summary as
text and `rlhf report`'s figures as images at the last step.
"""

from __future__ import annotations

import json
import os
from typing import Any


class TensorBoardRun:
    name = "tensorboard"

    def __init__(self, logdir: str, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.where = logdir
        self.writer = SummaryWriter(logdir)
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(params.items())), 0)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_events(self, step: int, events: list[dict[str, Any]]) -> None:
        by_tag: dict[tuple[str, int], list[str]] = {}
        for e in events:
            by_tag.setdefault((f"events/{e['kind']}", e["step"]), []).append(e["what"])
        for (tag, at), lines in by_tag.items():
            self.writer.add_text(tag, "\n\n".join(lines), at)
        self.writer.flush()

    def end(self, step: int, summary: dict[str, Any], events: list[dict[str, Any]], images: list[str]) -> None:
        import matplotlib.image

        self.writer.add_text("summary", "    " + json.dumps(summary, indent=1, default=str).replace("\n", "\n    "),
                             step)
        for path in images:
            pixels = matplotlib.image.imread(path)  # (H, W, 3 or 4) floats in [0, 1]
            self.writer.add_image("figures/" + os.path.splitext(os.path.basename(path))[0], pixels[..., :3], step,
                                  dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
