"""Tensor-parallel ranks as processes on torch.distributed: the engine's process is rank 0.

Rank 0 runs the scheduler, the sampler and its own shard of the model; ranks 1..N-1 are
processes it starts, each holding its shard of the model
(distributed/parallel.py) and the KV cache of its KV heads. Every step rank 0 broadcasts
what the step computes (the tokens, positions and block tables of each scheduled request);
each rank builds the same flat batch from it and runs the same forward pass, and the
ranks meet at the all-reduce after each row-parallel layer. Only rank 0 computes logits
and samples. Weight updates, sleep and wake reach the ranks the same way, as commands.

The group is gloo over TCP (the CPU's collective backend; NCCL would serve CUDA ranks,
which sluice does not run yet), built from a TCPStore rank 0 hosts, not as torch's default
process group, so that a trainer's own group or a weight-update group can live beside it.
A rank that dies closes its connections, and the collective its peers are in fails at once.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Collectives wait this long for a peer; an idle engine's ranks wait in a broadcast for
# the next command, so this is not a step deadline (a dead peer fails them at once).
IDLE_TIMEOUT = timedelta(days=7)
# How long rank 0 waits for the other ranks to load their shards.
START_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(size: int) -> int:
    """The machine's cores shared out: on 2 cores, 2 ranks get one thread each."""
    return max(1, (os.cpu_count() or 1) // size)


class TPGroup:
    """One tensor-parallel group over gloo: all-reduce, and broadcasts of tensors and
    picklable objects from rank 0."""

    def __init__(self, host: str, port: int, rank: int, size: int):
        self.host, self.port, self.rank, self.size = host, port, rank, size
        self.pg = None

    def connect(self) -> None:
        """Join the group; returns once every rank has (rank 0 hosts the store)."""
        store = dist.TCPStore(self.host, self.port, self.size, self.rank == 0, timeout=timedelta(seconds=START_TIMEOUT_S),
                              wait_for_workers=False)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("sluice-tp", store), self.rank, self.size, IDLE_TIMEOUT)
        self.store = store  # rank 0 hosts it for the group's life; ranks report readiness in it

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """Sum (or max) over the ranks, in place."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        self.pg.allreduce([t], opts).wait()

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype), in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([t], opts).wait()
        return t

    def broadcast_object(self, obj=None):
        """Rank 0's picklable `obj`, on every rank."""
        if self.rank == 0:
            data = pickle.dumps(obj)
            self.broadcast(torch.tensor([len(data)], dtype=torch.int64))
            self.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return obj
        n = int(self.broadcast(torch.zeros(1, dtype=torch.int64)).item())
        buf = self.broadcast(torch.empty(n, dtype=torch.uint8))
        return pickle.loads(buf.numpy().tobytes())

    def broadcast_tensors(self, named: list[tuple[str, torch.Tensor]] | None = None) -> list[tuple[str, torch.Tensor]]:
        """Rank 0's named tensors on every rank: their names, dtypes and shapes as one
        object, then each tensor as itself (no pickling of the data)."""
        meta = self.broadcast_object([(n, t.dtype, tuple(t.shape)) for n, t in named] if self.rank == 0 else None)
        if self.rank == 0:
            for _, t in named:
                self.broadcast(t.contiguous())
            return named
        return [(n, self.broadcast(torch.empty(shape, dtype=dtype))) for n, dtype, shape in meta]


def share_weights(group: TPGroup, weights=None):
    """A checkpoint read once: rank 0 iterates `weights` and sends each tensor as it goes;
    the other ranks iterate what they receive (each then keeps its shard). One read and
    one dequantization (GGUF's is slow) instead of one per rank."""
    if group.rank == 0:
        for name, t in weights:
            group.broadcast_object((name, t.dtype, tuple(t.shape)))
            yield name, group.broadcast(t.contiguous())
        group.broadcast_object(None)
        return
    while (meta := group.broadcast_object()) is not None:
        name, dtype, shape = meta
        yield name, group.broadcast(torch.empty(shape, dtype=dtype))


def step_inputs(plan) -> list[tuple]:
    """What the other ranks need of a step plan to build its flat batch (runner._prepare):
    per scheduled request its tokens, first position, blocks, whether logits are due and
    how many drafts it verifies. Sampling parameters and grammars stay on rank 0."""
    return [(e.token_ids, e.start_pos, e.block_ids, e.needs_logits, len(e.draft_token_ids), e.group_block_ids)
            for e in plan.scheduled]


def plan_from_inputs(inputs: list[tuple]):
    from sluice.core.scheduler import ScheduledRequest, StepPlan
    entries = [ScheduledRequest("", ids, start, blocks, logits, None, [], [], draft_token_ids=[0] * drafts,
                                group_block_ids=groups)
               for ids, start, blocks, logits, drafts, groups in inputs]
    return StepPlan(entries, sum(len(e.token_ids) for e in entries))


class TensorParallel:
    """Rank 0's handle on the other ranks: starts them, sends them each step and command.

    The ranks are fresh Python processes (`python -m
    sluice.distributed.tp_rank`), given the engine's config on stdin, so that
    nothing of the caller's own script runs again in them (multiprocessing's spawn would
    re-import it). Each reports in the group's store when its shard is loaded."""

    def __init__(self, size: int):
        self.size = size
        # Rank 0's end of the group; the model's row-parallel layers hold it from the start.
        self.group = TPGroup("127.0.0.1", free_port(), 0, size)
        self.procs: list = []
        self.closed = False

    def start(self, config, spec) -> None:
        """Start ranks 1..N-1 with the engine's config (its cache's num_blocks set) and the
        model's registry.model_spec, and join the group with them; they then load their
        shards (wait_ready)."""
        import atexit
        import subprocess
        import sys
        import threading
        atexit.register(self.close)
        blob = pickle.dumps((config, spec))
        for rank in range(1, self.size):
            proc = subprocess.Popen([sys.executable, "-m", "sluice.distributed.tp_rank", str(rank),
                                     str(self.size), str(self.group.port)], stdin=subprocess.PIPE)
            proc.stdin.write(blob)
            proc.stdin.close()
            self.procs.append(proc)
        torch.set_num_threads(threads_per_rank(self.size))
        # Joining blocks until every rank has joined: watch them meanwhile, so that one that
        # fails before it joins is reported rather than waited for.
        joined: list[BaseException | None] = []
        t = threading.Thread(target=lambda: joined.append(_call(self.group.connect)), daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            if not t.is_alive():
                break
            self.check_alive()
        if joined[0] is not None:
            raise RuntimeError(f"tensor-parallel ranks could not form a group: {joined[0]}")

    def wait_ready(self) -> None:
        """Wait for every other rank to have loaded its shard and allocated its cache;
        re-raise the first one's failure as a RuntimeError."""
        import time
        store = self.group.store
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank in range(1, self.size):
            key = f"ready{rank}"
            while not store.check([key]):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start within {START_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
            status = store.get(key).decode()
            if status != "ok":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {status}")

    def send(self, command: tuple) -> None:
        self.group.broadcast_object(command)

    def forward(self, plan) -> None:
        """Send the other ranks a step's inputs; they build the same flat batch and run
        their shards beside rank 0's."""
        self.send(("forward", step_inputs(plan)))

    def dead(self) -> list[str]:
        """The ranks whose process has exited, as 'rank (exit status)'."""
        return [f"{i + 1} (exit status {p.returncode})" for i, p in enumerate(self.procs) if p.poll() is not None]

    def check_alive(self) -> None:
        dead = self.dead()
        if dead:
            raise RuntimeError(f"tensor-parallel rank(s) {', '.join(dead)} exited")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.group.pg is not None and all(p.poll() is None for p in self.procs):
                self.send(("stop",))
        except Exception:  # a dead rank: the broadcast fails; terminate below
            pass
        for p in self.procs:
            try:
                p.wait(5)
            except Exception:
                p.kill()


def _call(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # reported by the caller
        return e
    return None
