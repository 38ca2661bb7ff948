#!/usr/bin/env python
"""GRPO on the embedded default: tiny Llama, 2-operand addition, CPU, no downloads.

    python examples/grpo_trainer.py                       # SFT warm start → eval → GRPO → eval
    python examples/grpo_trainer.py --steps 20 --seed 2 --rollout.group_size 4
    python examples/grpo_trainer.py --help                # every config key with its doc
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rlhf.cli import grpo_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(grpo_main())
