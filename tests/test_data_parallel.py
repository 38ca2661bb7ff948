"""Data parallelism is exact: two gloo ranks, each training on its half of a GRPO batch (whole groups), take the
same update as one rank on the whole batch (real torch.distributed over 127.0.0.1, two processes)."""

import copy
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf.config import AlgorithmConfig, OptimConfig
from rlhf.train.dist import GlooDataParallel
from rlhf.train.engine import TrainEngine
from rlhf.weights import export_state
from tests.test_runtime import free_port
from tests.test_train_engine import _rl_batch

GROUP = 4


def _engine(model):
    engine = TrainEngine(model, OptimConfig(micro_batch_size=16, mini_batches=1, grad_clip=0, warmup_steps=0),
                         AlgorithmConfig(kl_coef=0.1), keep_reference=False,
                         dp=GlooDataParallel() if dist.is_initialized() else None)
    engine.optimizer = torch.optim.SGD(engine.params, lr=1.0)  # the update is minus the gradient
    return engine


def _update(model, batch):
    before = {k: v.clone() for k, v in export_state(model).items()}
    _engine(model).train_step(batch)
    return {k: v - before[k] for k, v in export_state(model).items()}


def _rank(rank, port, model, shards, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # torch.multiprocessing hands both ranks the same shared-memory parameters: each needs its own, as a
        # rank that built its model has
        update = _update(copy.deepcopy(model), shards[rank])
        if rank == 0:
            torch.save(update, out)
    finally:
        dist.destroy_process_group()


def test_two_ranks_on_halves_of_the_batch_update_as_one_rank_on_all_of_it(diverse, tmp_path):
    model, tok = diverse
    batch = _rl_batch(model, tok, group=GROUP)  # 4 prompts x 4 samples, random advantages
    batch["ref_logprobs"] = batch["old_logprobs"] + 0.1 * batch["response_mask"]
    rows = batch["input_ids"].shape[0]
    halves = [{k: v[: rows // 2] for k, v in batch.items()}, {k: v[rows // 2:] for k, v in batch.items()}]
    one = _update(copy.deepcopy(model), batch)
    out = tmp_path / "update.pt"
    mp.start_processes(_rank, args=(free_port(), copy.deepcopy(model), halves, str(out)), nprocs=2,
                       start_method="spawn", join=True)
    two = torch.load(out)
    assert any(u.abs().max() > 1e-4 for u in one.values())
    for name in one:
        assert torch.allclose(one[name], two[name], atol=1e-5), (name, (one[name] - two[name]).abs().max())
