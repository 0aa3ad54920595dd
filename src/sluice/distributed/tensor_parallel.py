"""Tensor-parallel ranks as processes on torch.distributed: the engine's process is rank 0.

Rank 0 runs the scheduler, the sampler and its own shard of the model; ranks 1..N-1 are
processes it starts (torch.multiprocessing, spawn), each holding its shard of the model
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
        self._store = store  # rank 0's store must outlive the rendezvous

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum over the ranks, in place."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
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


def step_inputs(plan) -> list[tuple]:
    """What the other ranks need of a step plan to build its flat batch (runner._prepare):
    per scheduled request its tokens, first position, blocks, whether logits are due and
    how many drafts it verifies. Sampling parameters and grammars stay on rank 0."""
    return [(e.token_ids, e.start_pos, e.block_ids, e.needs_logits, len(e.draft_token_ids)) for e in plan.scheduled]


def plan_from_inputs(inputs: list[tuple]):
    from sluice.core.scheduler import ScheduledRequest, StepPlan
    entries = [ScheduledRequest("", ids, start, blocks, logits, None, [], [], draft_token_ids=[0] * drafts)
               for ids, start, blocks, logits, drafts in inputs]
    return StepPlan(entries, sum(len(e.token_ids) for e in entries))


class TensorParallel:
    """Rank 0's handle on the other ranks: starts them, sends them each step and command."""

    def __init__(self, size: int):
        self.size = size
        # Rank 0's end of the group; the model's row-parallel layers hold it from the start.
        self.group = TPGroup("127.0.0.1", free_port(), 0, size)
        self.procs = []
        self.closed = False

    def start(self, config) -> None:
        """Start ranks 1..N-1 with the engine's config (its cache's num_blocks set) and join
        the group with them; they then load their shards (wait_ready)."""
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self._ready = ctx.Queue()
        self.procs = [ctx.Process(target=_worker_main, args=(rank, self.size, self.group.port, config, self._ready),
                                  name=f"sluice-tp{rank}", daemon=True) for rank in range(1, self.size)]
        for p in self.procs:
            p.start()
        torch.set_num_threads(threads_per_rank(self.size))
        self.group.connect()

    def wait_ready(self) -> None:
        """Wait for every other rank to have loaded its shard and allocated its cache;
        re-raise the first one's failure as a RuntimeError."""
        import queue
        for _ in self.procs:
            try:
                status, rank, message = self._ready.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"tensor-parallel ranks did not start within {START_TIMEOUT_S:.0f} s") from None
            if status != "ok":
                self.close()
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {message}")

    def send(self, command: tuple) -> None:
        self.group.broadcast_object(command)

    def check_alive(self) -> None:
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel rank process(es) {', '.join(dead)} died")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                self.send(("stop",))
        except Exception:  # a dead rank: the broadcast fails; terminate below
            pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()


def _worker_main(rank: int, size: int, port: int, config, ready) -> None:
    """A rank other than 0: load its shard, then run the commands rank 0 broadcasts."""
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tp{rank} %(name)s: %(message)s")
    torch.set_num_threads(threads_per_rank(size))
    group = TPGroup("127.0.0.1", port, rank, size)
    try:
        group.connect()
        from sluice.engine.llm_engine import build_shard
        shard = build_shard(config, group)
    except Exception as e:  # reported to rank 0, which raises it
        logger.exception("rank %d failed to start", rank)
        ready.put(("error", rank, f"{type(e).__name__}: {e}"))
        return
    ready.put(("ok", rank, ""))
    runner = shard.runner
    while True:
        command = group.broadcast_object()
        kind = command[0]
        if kind == "forward":
            runner.forward_only(plan_from_inputs(command[1]))
        elif kind == "update":
            shard.apply_weights(group.broadcast_tensors())
        elif kind == "sleep":
            runner.free_kv()
        elif kind == "wake":
            runner.allocate_kv()
        elif kind == "stop":
            return
