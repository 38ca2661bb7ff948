"""TrainWorker: one per torchrun rank (SPMD), an RPC server the controller drives.

What is where:

    worker.py    TrainWorker: the model's build, the GRPO endpoints (logprobs, train step), heartbeat, colocation
                 events, the node's scheduler
    state.py     weights (the pieces this rank holds to the MetaServer, HF directory, checksum) and checkpoint files (save, writer, load)
    baseline.py  the SFT warm start and baseline steps, its eval, the pre-flight straggler check
"""

from rlhf.services.train_worker.worker import TrainWorker

__all__ = ["TrainWorker"]
