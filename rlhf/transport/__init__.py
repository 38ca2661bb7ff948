"""Transport: the only code that speaks a wire.

    http.py           the RPC server every service runs (aiohttp): the run token, errors as data, heartbeats
    client.py         Client: calls with timeouts, retries (tenacity) and per-tensor checksums; the event loop thread
    wire.py           tensors on the wire: raw buffers + a JSON header (never a pickle)
    shm.py            weights through shared memory files (the MetaServer's shm path)
    cuda_ipc.py       weights that stay on the GPU: CUDA IPC handles in JSON
    weights_group.py  the process group of train rank 0 and the rollout servers (the distributed weights update)
"""
