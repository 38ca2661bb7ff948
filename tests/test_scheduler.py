"""Scheduler service: jobs start and stop, the lease reaps them, nothing outlives its parent."""

import os
import signal
import sys
import time

import psutil
import pytest

from rlhf.errors import HTTPStatusError
from rlhf.services.scheduler import SchedulerClient
from rlhf.transport.client import Client, LoopThread
from tests.conftest import ROOT

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _gone(pid, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:  # gone between two looks, or before the first
            return True
        time.sleep(0.05)
    return False


@pytest.fixture()
def scheduler(tmp_path):
    os.makedirs(tmp_path / "logs", exist_ok=True)
    loop = LoopThread()
    made = []

    def make(lease_s=5.0):
        s = SchedulerClient(str(tmp_path), "tok", lease_s, 60, loop)
        made.append(s)
        return s

    yield make, loop
    for s in made:
        s.close()
    loop.close()


def test_submit_list_cancel(scheduler):
    make, loop = scheduler
    s = make()
    job = s.submit("sleeper-0", "test", SLEEPER, {"X": "1"})
    assert job["state"] == "running" and psutil.pid_exists(job["pid"])
    assert [j["name"] for j in s.jobs()] == ["sleeper-0"]
    stopped = loop.run(s.stop_job("sleeper-0", timeout_s=15))
    assert stopped["state"] == "stopped" and _gone(job["pid"])


def test_lapsed_lease_stops_every_job(scheduler):
    make, loop = scheduler
    s = make(lease_s=1.0)
    pids = [s.submit(f"sleeper-{i}", "test", SLEEPER, {})["pid"] for i in range(2)]
    s._renewer.cancel()  # the controller hangs: no more heartbeats
    assert all(_gone(pid, 10) for pid in pids)
    assert _gone(s.proc.pid, 10)  # the scheduler exits too


def test_jobs_die_with_a_killed_scheduler(scheduler):
    make, loop = scheduler
    s = make()
    pid = s.submit("sleeper", "test", SLEEPER, {})["pid"]
    os.kill(s.proc.pid, signal.SIGKILL)
    assert _gone(pid, 10)


def test_scheduler_rejects_requests_without_the_token(scheduler):
    make, loop = scheduler
    s = make()
    for method, path in [("POST", "/jobs"), ("GET", "/jobs"), ("GET", "/jobs/x"), ("DELETE", "/jobs/x"),
                         ("POST", "/lease"), ("GET", "/health")]:
        with pytest.raises(HTTPStatusError) as err:
            loop.run(Client(s.url, "wrong").call(path, {"name": "x", "command": SLEEPER}, method=method))
        assert err.value.status == 401, path
    assert s.jobs() == []


def test_an_exception_inside_the_scheduler_is_in_its_log_and_the_callers_error(scheduler, tmp_path):
    from rlhf.errors import RemoteError

    make, loop = scheduler
    s = make()
    with pytest.raises(RemoteError) as err:  # a job without a command: the handler's own KeyError
        loop.run(s.client.call("/jobs", {"name": "broken"}, stage="startup", step=0))
    info = err.value.info
    assert (info.error_class, info.message, info.role) == ("KeyError", "'command'", "scheduler")
    log = (tmp_path / "logs" / "scheduler-0.log").read_text()
    assert "scheduler-0: POST /jobs failed at step 0: KeyError: 'command'" in log
    assert s.jobs() == []


def test_the_scheduler_starts_without_torch(tmp_path):
    """The scheduler only routes JSON and starts processes: loading torch (a second of its start, on the way to
    every run's rollout servers) is for processes that compute. Its imports pull in the config (loss and model
    registries), the RPC layer (wire, http, client) and the shared-memory sweep, and its service starts a worker
    thread (whose torch threads are set only where torch is loaded): none of it may load torch."""
    import subprocess

    probe = ("import sys, rlhf.services.scheduler as s; from rlhf.config import Config; "
             f"s.Scheduler({str(tmp_path)!r}, 'k', 10.0, Config().resilience, 0); "
             "print(sorted(m for m in ('torch', 'numpy', 'safetensors.torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


# a job that starts a helper in a session of its own (setsid: out of its process group) and waits
DETACHER = [sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen(['sleep', '300'], "
            "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            "open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(120)"]


def _helper(path, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def test_a_contained_job_takes_what_it_detached_with_it_when_stopped_or_killed(scheduler, tmp_path):
    """env-0's containment: the job and what it starts (here a `setsid` helper, out of its process group, which the
    group stop misses) share a cgroup, killed when the job is stopped and when it dies (SIGKILL); its pids limit
    holds."""
    from rlhf.contain import Cgroup

    if Cgroup.make("rlhf-probe", 8) is None:
        pytest.skip(f"no cgroups here: {Cgroup.why}")
    from rlhf.contain import sweep

    sweep("rlhf-probe")
    make, loop = scheduler
    s = make()
    job = s.submit("env-0", "env", [*DETACHER, str(tmp_path / "a")], {}, contain={"pids_max": 16, "memory_mb": 0})
    helper = _helper(tmp_path / "a")
    assert os.getpgid(helper) != os.getpgid(job["pid"])  # detached: out of the group the job stop signals
    loop.run(s.stop_job("env-0", timeout_s=15))
    assert _gone(job["pid"]) and _gone(helper)
    job = s.submit("env-1", "env", [*DETACHER, str(tmp_path / "b")], {}, contain={"pids_max": 16})
    helper = _helper(tmp_path / "b")
    os.kill(job["pid"], signal.SIGKILL)  # its helper would be re-parented to init and live on
    assert _gone(helper)
    log_path, deadline = tmp_path / "logs" / "scheduler-0.log", time.monotonic() + 10
    while "job env-1 left" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)  # the cgroup is killed before the line that reports it is written
    log = log_path.read_text()
    assert "job env-1 left 1 process(es) running" in log and "sleep" in log
    import glob

    assert not glob.glob("/sys/fs/cgroup/unified/rlhf-*env-*") + glob.glob("/sys/fs/cgroup/rlhf-*env-*")


def test_a_subreaper_stops_the_orphans_of_its_children_as_it_exits(tmp_path):
    """Without cgroups env-0 is a child subreaper: a helper whose parent exited is re-parented to it, not to init,
    and stopped as it exits."""
    script = ("import subprocess, sys, time\n"
              "from rlhf import contain\n"
              "assert contain.keep_orphans()\n"
              "middle = subprocess.Popen([sys.executable, '-c', \"import subprocess; p = subprocess.Popen(['sleep', "
              "'300'], start_new_session=True, stdout=subprocess.DEVNULL); print(p.pid)\"], stdout=subprocess.PIPE, "
              "text=True)\n"
              "helper = int(middle.communicate()[0])\n"  # its parent has exited: the helper is an orphan now
              "print(helper, flush=True)\n"
              "print(contain.stop_descendants(), flush=True)\n")
    import subprocess

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    helper, stopped = out.stdout.splitlines()
    assert f"{helper} sleep" in stopped and _gone(int(helper))
