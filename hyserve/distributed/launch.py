"""A worker process per rank: the engine (or a test) hosts the rendezvous store, the workers join the
process groups, and `run(fn, *args)` calls `fn(state, *args)` on every rank and returns their results.

A rank that raises, dies or stops answering fails the call with a RankFailedError naming it; its peers'
collectives fail within the group timeout (groups.py), so nothing waits forever. A failed pool is closed:
torch.distributed cannot recover a group one of whose members is gone.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hyserve.distributed.config import ParallelConfig
from hyserve.distributed.groups import default_timeout_s, join, make_state, shutdown

_POLL_S = 0.1


class RankFailedError(RuntimeError):
    """A rank of a RankPool failed; the message holds each failed rank's error."""


def _next_task(tasks: Any, parent: int) -> Any:
    """The next task, or None once the pool closes or its process is gone (a SIGKILLed engine cannot
    close it, and a daemon worker outlives a parent that did not exit normally)."""
    while True:
        try:
            return tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _worker(rank: int, config: ParallelConfig, port: int, device: str, timeout_s: float, threads: int,
            parent: int, tasks: Any, results: Any) -> None:
    torch.set_num_threads(threads)
    if device == "cuda":  # one GPU per rank
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    try:
        store = dist.TCPStore("127.0.0.1", port, None, is_master=False)
        join(config.world_size, rank, store, device=device, timeout_s=timeout_s)
        states = {config: make_state(config, rank, device=device, timeout_s=timeout_s)}
    except BaseException:
        results.put((rank, 0, False, traceback.format_exc()))
        return
    results.put((rank, 0, True, None))
    while (task := _next_task(tasks, parent)) is not None:
        seq, fn, args, layout = task
        try:
            if layout not in states:  # the same order on every rank: runs are executed by all of them
                states[layout] = make_state(layout, rank, device=device, timeout_s=timeout_s)
            results.put((rank, seq, True, fn(states[layout], *args)))
        except BaseException:
            results.put((rank, seq, False, traceback.format_exc()))
    shutdown()


class RankPool:
    """`config.world_size` worker processes (spawned: CUDA and a forked parent do not mix). device "cuda"
    gives rank r the GPU cuda:r (and NCCL); "cpu" gives gloo."""

    def __init__(self, config: ParallelConfig, *, device: str = "cpu", timeout_s: float | None = None,
                 start_timeout_s: float = 180.0, threads: int | None = None, grace_s: float | None = None):
        """`grace_s`: how long a call waits for the other ranks once one failed (default: the group
        timeout and 5 s, so that every rank's error is reported); then the pool stops them all."""
        timeout_s = default_timeout_s() if timeout_s is None else timeout_s
        self.config, self.timeout_s, self.world = config, timeout_s, config.world_size
        self.grace_s = timeout_s + 5.0 if grace_s is None else grace_s
        threads = threads or max(1, (os.cpu_count() or 1) // self.world)
        # port 0: the OS picks a free port, so concurrent pools (and test runs) never collide
        self._store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, daemon=True, args=(r, config, self._store.port, device, timeout_s, threads,
                                                           os.getpid(), self._tasks[r], self._results))
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()
        self._seq, self.broken = 0, False
        self._collect(0, time.monotonic() + start_timeout_s)

    def run(self, fn: Callable[..., Any], *args: Any, layout: ParallelConfig | None = None,
            timeout_s: float | None = None) -> list[Any]:
        """[fn(state, *args) on rank r for r in ranks]; fn must be importable (a module-level function).
        `state` has the groups of `layout` (default: the pool's config), any layout of the same size."""
        layout = layout or self.config
        if layout.world_size != self.world:
            raise ValueError(f"a layout of {layout.world_size} ranks cannot run on a pool of {self.world}")
        if self.broken:
            raise RankFailedError("the rank pool failed earlier and is closed; start a new one")
        self._seq += 1
        for q in self._tasks:
            q.put((self._seq, fn, args, layout))
        return self._collect(self._seq, None if timeout_s is None else time.monotonic() + timeout_s)

    def _collect(self, seq: int, deadline: float | None) -> list[Any]:
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(out) + len(errors) < self.world:
            now = time.monotonic()
            if deadline is not None and now > deadline:
                missing = sorted(set(range(self.world)) - set(out) - set(errors))
                errors.update({r: "no answer before the deadline" for r in missing})
                break
            try:
                rank, s, ok, value = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if p.exitcode is not None and r not in out and r not in errors:
                        errors[r] = f"the process exited with code {p.exitcode}"
                if errors and deadline is None:
                    # peers of a failed rank fail in their next collective, within the group timeout
                    deadline = now + self.grace_s
                continue
            if s != seq:
                continue
            if ok:
                out[rank] = value
            else:
                errors[rank] = value
                deadline = min(deadline or float("inf"), time.monotonic() + self.grace_s)
        if errors:
            self.close(wait_s=0.0)  # ranks still in a collective with a failed one would wait out its timeout
            self.broken = True
            detail = "\n".join(f"--- rank {r}: {msg.strip()}" for r, msg in sorted(errors.items()))
            raise RankFailedError(f"{len(errors)} of {self.world} ranks failed (ranks {sorted(errors)}):\n{detail}")
        return [out[r] for r in range(self.world)]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the workers: each leaves its loop at once, or is killed after `wait_s`."""
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                q.put(None)
        deadline = time.monotonic() + wait_s
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in self._tasks:
            q.cancel_join_thread()  # a killed reader never drains its queue: exiting must not wait for it
        self.broken = True

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
