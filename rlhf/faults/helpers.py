"""Helper processes for background faults: a CPU burner and an fsync writer.

    python -m rlhf.faults.helpers burn --load 0.95 --cpu 1
    python -m rlhf.faults.helpers write --path DIR/.rlhf-io-1234-0 --block-kb 1024 --max-mb 256

Each dies with the process that started it (PDEATHSIG) and with its own process group.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from rlhf.procs import set_pdeathsig


def burn(load: float, cpu: int) -> None:
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})
    period = 0.02
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < period * load:
            pass
        if load < 1.0:
            time.sleep(period * (1.0 - load))


def write(path: str, block_kb: int, max_mb: int) -> None:
    block = os.urandom(block_kb * 1024)
    limit = max_mb * 1024 * 1024
    with open(path, "wb", buffering=0) as fh:
        while True:
            fh.write(block)
            os.fsync(fh.fileno())
            if fh.tell() >= limit:
                fh.seek(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("burn")
    b.add_argument("--load", type=float, default=0.95)
    b.add_argument("--cpu", type=int, default=-1)
    w = sub.add_parser("write")
    w.add_argument("--path", required=True)
    w.add_argument("--block-kb", type=int, default=1024)
    w.add_argument("--max-mb", type=int, default=256)
    args = parser.parse_args(argv)
    set_pdeathsig()
    if os.getppid() == 1:  # the starter died before PDEATHSIG was set
        return 1
    if args.what == "burn":
        burn(args.load, args.cpu)
    else:
        write(args.path, args.block_kb, args.max_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
