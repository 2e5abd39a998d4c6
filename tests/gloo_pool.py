"""Long-lived gloo process groups for multi-rank tests.

Spawning a rank costs seconds on a small CPU machine, so each world size gets one pool of
worker processes for the whole session; a test submits a picklable function (defined at module
level) that every rank runs as ``fn(rank, world_size, *args)``. Every task and every collective has
a timeout, so a broken test fails instead of hanging CI; after a timeout the pool is rebuilt.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

COLLECTIVE_TIMEOUT_S = 60
TASK_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class RankError:
    """An exception raised on one rank, carried back as text (exceptions need not pickle)."""

    rank: int
    type_name: str
    message: str
    traceback: str


class RanksFailed(AssertionError):
    def __init__(self, errors: list[RankError]):
        self.errors = errors
        text = "\n".join(f"--- rank {e.rank}: {e.type_name}: {e.message}\n{e.traceback}" for e in errors)
        super().__init__(f"{len(errors)} rank(s) raised:\n{text}")


def _worker(rank, world_size, port, tasks, results, backend="gloo", collective_timeout_s=COLLECTIVE_TIMEOUT_S):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    options = {}
    if backend == "nccl":  # one process per GPU; tests place tensors with tests.faults.cases.device()
        torch.cuda.set_device(rank)
        options["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout_s), **options)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException as err:  # report every failure, keep serving
            results.put((rank, False, RankError(rank, type(err).__name__, str(err), traceback.format_exc())))
    # No destroy_process_group: it waits for every peer, and process exit releases the sockets anyway.


def _context():
    """Workers fork from a server process that has imported torch once (multiprocessing's forkserver):
    a spawned worker spent about 3 s of CPU importing torch, and the suite starts some 30 of them (world
    sizes 2-8, the fault suite's pools and their restarts). The server is a fresh interpreter, not a fork
    of pytest, so the workers inherit none of the test process's threads or state."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    return ctx


class GlooPool:
    """``world_size`` worker processes in one process group (gloo by default; ``backend="nccl"`` puts
    rank r on GPU r). ``collective_timeout_s`` bounds every collective inside the workers."""

    def __init__(self, world_size: int, *, backend: str = "gloo", collective_timeout_s: float = COLLECTIVE_TIMEOUT_S):
        self.world_size = world_size
        self.backend = backend
        self.collective_timeout_s = collective_timeout_s
        self._start()

    def _start(self) -> None:
        ctx = _context()
        port = free_port()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(rank, self.world_size, port, self._tasks[rank], self._results,
                                              self.backend, self.collective_timeout_s), daemon=True)
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def run_collect(self, fn, *args, timeout: float = TASK_TIMEOUT_S, **kwargs) -> list[tuple[bool, object]]:
        """Run ``fn`` on every rank; return ``[(ok, result_or_RankError)]`` indexed by rank."""
        for tasks in self._tasks:
            tasks.put((fn, args, kwargs))
        outcome: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        while len(outcome) < self.world_size:
            remaining = deadline - time.monotonic()
            dead = [p.pid for p in self._procs if not p.is_alive()]
            if remaining <= 0 or dead:
                self.close(kill=True)
                self._start()
                missing = sorted(set(range(self.world_size)) - set(outcome))
                why = f"workers died ({dead})" if dead else f"timed out after {timeout}s"
                raise TimeoutError(f"{getattr(fn, '__name__', fn)}: ranks {missing} {why}; pool restarted")
            try:
                rank, ok, value = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            outcome[rank] = (ok, value)
        return [outcome[rank] for rank in range(self.world_size)]

    def run(self, fn, *args, timeout: float = TASK_TIMEOUT_S, **kwargs) -> list:
        """Run ``fn`` on every rank and return the per-rank results; raise if any rank raised."""
        outcome = self.run_collect(fn, *args, timeout=timeout, **kwargs)
        errors = [value for ok, value in outcome if not ok]
        if errors:
            raise RanksFailed(errors)
        return [value for _, value in outcome]

    def restart(self) -> None:
        """Kill the workers and start a fresh group (after a collective broke the current one)."""
        self.close(kill=True)
        self._start()

    def close(self, kill: bool = False) -> None:
        """Stop the workers: ask them to leave, then kill whichever has not left after a second. A
        worker's exit can wait seconds for its gloo peers (the suite's teardown spent 5 s per pool in that
        wait); it has no state to save, so killing it loses nothing."""
        for proc, tasks in zip(self._procs, self._tasks):
            if kill:
                proc.kill()
            else:
                tasks.put(None)
        deadline = time.monotonic() + (5 if kill else 1)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
