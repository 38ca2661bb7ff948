#!/usr/bin/env python
"""The SFT baseline alone, on the same train engine as GRPO.

    python examples/sft_trainer.py                        # sft.max_steps steps, then greedy eval
    python examples/sft_trainer.py --steps 300 --seed 2
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rlhf.cli import sft_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(sft_main())
