import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config):
    """Byte-compile the package once: the end-to-end tests start some 200 Python processes, and where
    PYTHONDONTWRITEBYTECODE is set (this kind of machine) each would compile every rlhf module it imports again
    (about 0.3 s of CPU a process). Existing bytecode is read whatever that variable says."""
    import compileall

    compileall.compile_dir(os.path.join(ROOT, "rlhf"), quiet=2)


def wait_until(condition, timeout_s: float, what: str, poll_s: float = 0.05):
    """Poll `condition()` until it returns something true (returned), failing after timeout_s with `what`."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


@pytest.fixture(scope="session")
def tiny():
    """A random-init tiny Llama and the char tokenizer (session-wide; tests must not mutate it)."""
    from rlhf.config import ModelConfig
    from rlhf.models import build_model_and_tokenizer

    return build_model_and_tokenizer(ModelConfig(name="tiny-llama"), seed=0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (this machine has none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def diverse_model(preset: str = "tiny-llama", seed: int = 0):
    """A random model with large weights, so greedy outputs differ between prompts and steps.

    The default init (std 0.02) gives a near-uniform model that repeats one token everywhere,
    which would make token-for-token comparisons trivially true.
    """
    from rlhf.config import ModelConfig
    from rlhf.models import build_model_and_tokenizer

    model, tok = build_model_and_tokenizer(ModelConfig(name=preset), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model, tok


@pytest.fixture(scope="session")
def diverse():
    return diverse_model("tiny-llama", seed=0)


SGLANG_KEY = "sglang-k3y"
SGLANG_MAX_QUEUED = 2


def start_sglang_launch(tmp, model_dir: str, args=(), env=None):
    """`python -m rlhf.services.sglang_launch` (as `sglang.launch_server` runs) on model_dir with the test key;
    returns (process, url) once it answers /health (the process is stopped if it never does)."""
    import requests

    from rlhf.control.fleet import free_port
    from rlhf.procs import spawn, stop_group

    port = free_port()
    proc = spawn([sys.executable, "-m", "rlhf.services.sglang_launch", "--model-path", model_dir, "--port", str(port),
                  "--api-key", SGLANG_KEY, *args], env={**os.environ, "PYTHONPATH": ROOT, **(env or {})}, cwd=ROOT,
                 log_path=str(tmp / "server.out"))
    url = f"http://127.0.0.1:{port}"

    def healthy():
        assert proc.poll() is None, (tmp / "server.out").read_text()[-2000:]
        try:
            return requests.get(url + "/health", timeout=1).status_code == 200
        except requests.ConnectionError:
            return False

    try:
        wait_until(healthy, 120, "the server to answer /health")
    except BaseException:
        stop_group(proc)
        raise
    return proc, url


@pytest.fixture(scope="session")
def sglang_server(tmp_path_factory):
    """(url, model_dir): one server for the session, with an API key and a queue limit."""
    from rlhf.models.hf_dir import write_model_dir
    from rlhf.procs import stop_group

    tmp = tmp_path_factory.mktemp("sglang")
    model_dir = write_model_dir(str(tmp / "model"))
    proc, url = start_sglang_launch(tmp, model_dir, ["--random-seed", "3", "--max-queued-requests",
                                                     str(SGLANG_MAX_QUEUED)])
    try:
        yield url, model_dir
    finally:
        stop_group(proc)
