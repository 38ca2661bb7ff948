"""Checkpoints: how a run's state lies on disk.

    slots.py    slots written atomically and checksummed (latest, periodic), the newest good one found on resume
    sharded.py  a sharded layout's pieces (torch.distributed.checkpoint), loadable into another layout and world
    export.py   `rlhf export`: a checkpoint as an HF model directory
"""
