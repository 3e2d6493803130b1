"""Run a function on several CPU ranks (spawned processes, gloo) and collect what each reports.

``worker(rank, *args)`` must write ``out_dir / f"rank{rank}.json"``: a dict, with "traceback" when it raised. One
deadline covers all ranks together; a rank that hangs (a collective waiting for a dead peer) is killed, and every
failure becomes a test failure naming the rank."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp


def run_ranks(worker, args: tuple, out_dir: Path, world_size: int, deadline_s: float) -> list[dict]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(rank, *args)) for rank in range(world_size)]
    for p in procs:
        p.start()
    hung, deadline = [], time.monotonic() + deadline_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            hung.append(p.pid)
    reports = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        if not path.exists():
            pytest.fail(f"rank {rank} wrote no report (exit code {procs[rank].exitcode}, hung pids {hung})")
        report = json.loads(path.read_text())
        if "traceback" in report:
            pytest.fail(f"rank {rank} raised:\n{report['traceback']}")
        reports.append(report)
    if hung:
        pytest.fail(f"ranks still running after {deadline_s}s were killed: pids {hung}")
    return reports


def join_gloo(rank: int, world_size: int, init_file: str) -> None:
    """In a worker: one CPU thread, and the gloo group over the loopback interface (a stuck collective fails in 60 s)."""
    import datetime
    import os

    import torch

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                         timeout=datetime.timedelta(seconds=60))
