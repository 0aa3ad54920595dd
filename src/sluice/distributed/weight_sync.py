"""Weight updates from a trainer's process group (SGLang's `init_weights_update_group` +
`update_weights_from_distributed` shape), on torch.distributed.

The trainer is rank 0 of a group it opens with the inference servers: it hosts the
group's TCPStore and broadcasts each tensor; every server joins as a rank of its own
(`rank_offset` + its index) and receives them. The group is built from that store, not
as torch's default process group, so the trainer keeps its own default group for
training and a server can join several groups over its life.

Server side: `WeightGroups` (the server's open groups; POST /v1/weights/init_group joins
one, POST /v1/weights/update with `group_name` receives a set of tensors through it).
Trainer side: `WeightSender`, which does both ends of each call for the trainer:

    sender = WeightSender("http://127.0.0.1:8000", group_name="rl")   # opens the group
    sender.update(model.state_dict(), weight_version="step-10")         # pushes the weights

Tensors go over gloo (the CPU's backend); NCCL would carry CUDA tensors, which sluice's
engine does not run yet.
"""
from __future__ import annotations

import socket
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
BACKENDS = ("gloo",)
MAX_GROUPS = 8


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class WeightGroup:
    """One open group: this process's rank in it, and gloo over the trainer's store."""
    name: str
    rank: int
    world_size: int
    pg: object
    store: object

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([t], opts).wait()
        return t


def open_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str = "gloo", timeout_s: float = 60.0) -> WeightGroup:
    """Join (rank 0: host) the group; returns once all world_size ranks have joined, or
    raises after timeout_s."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (CPU tensors); got {backend!r}")
    store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"sluice-weights/{group_name}", store), rank, world_size,
                               timedelta(seconds=timeout_s))
    return WeightGroup(group_name, rank, world_size, pg, store)


def parse_tensor_specs(specs) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """[{"name", "dtype", "shape"}, ...] -> (name, dtype, shape) each; ValueError naming
    the first bad entry (what the server must know before it receives anything)."""
    if not isinstance(specs, list) or not specs:
        raise ValueError("tensors must be a non-empty list of {name, dtype, shape}")
    out = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError(f"tensors[{i}] must be an object with a string name")
        name, dtype, shape = spec["name"], spec.get("dtype"), spec.get("shape")
        if dtype not in DTYPES:
            raise ValueError(f"tensors[{i}] ({name!r}): dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if (not isinstance(shape, list) or not 1 <= len(shape) <= 4
                or any(isinstance(d, bool) or not isinstance(d, int) or not 0 < d <= 2**31 for d in shape)):
            raise ValueError(f"tensors[{i}] ({name!r}): shape must be a list of 1-4 positive integers, got {shape!r}")
        out.append((name, DTYPES[dtype], tuple(shape)))
    return out


class WeightGroups:
    """A server's open weight-update groups, by name."""

    def __init__(self):
        self.groups: dict[str, WeightGroup] = {}
        self.lock = threading.Lock()   # one transfer at a time per server

    def join(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
             backend: str = "gloo", timeout_s: float = 60.0) -> WeightGroup:
        """Blocking: run it off the event loop."""
        if not isinstance(group_name, str) or not group_name:
            raise ValueError("group_name must be a non-empty string")
        if group_name in self.groups:
            raise ValueError(f"group {group_name!r} is already open here; close it first")
        if len(self.groups) >= MAX_GROUPS:
            raise ValueError(f"this server has {MAX_GROUPS} groups open already; close one first")
        if not 1 <= rank_offset < world_size:
            raise ValueError(f"rank_offset must be in [1, world_size) (the trainer is rank 0); got {rank_offset} "
                             f"with world_size {world_size}")
        group = open_group(master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s)
        self.groups[group_name] = group
        return group

    def receive(self, group_name: str, specs) -> list[tuple[str, torch.Tensor]]:
        """Blocking: the tensors the trainer broadcasts, in the order of `specs`."""
        group = self.groups.get(group_name)
        if group is None:
            raise KeyError(group_name)
        parsed = parse_tensor_specs(specs)
        with self.lock:
            return [(name, group.broadcast(torch.empty(shape, dtype=dtype))) for name, dtype, shape in parsed]

    def close(self, group_name: str) -> bool:
        return self.groups.pop(group_name, None) is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WeightSender:
    """The trainer's end: opens a group with a sluice server (a single server or a data-
    parallel router, which joins with each of its replicas) and pushes weights to it."""

    def __init__(self, url: str, group_name: str = "trainer", master_address: str = "127.0.0.1",
                 master_port: int | None = None, api_key: str | None = None, timeout_s: float = 60.0):
        import httpx
        self.url = url.rstrip("/")
        self.group_name = group_name
        self.http = httpx.Client(timeout=timeout_s + 30,
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sluice-weights")
        info = self._check(self.http.get(f"{self.url}/v1/weights"))
        ranks = int(info["ranks"])       # the server's ranks in a group (its replicas)
        port = master_port or free_port()
        body = {"master_address": master_address, "master_port": port, "rank_offset": 1,
                "world_size": 1 + ranks, "group_name": group_name, "backend": "gloo", "timeout_s": timeout_s}
        # The server's join and ours each wait for the other; a refusal ends both at once.
        self.group = self._both(self.pool.submit(self.http.post, f"{self.url}/v1/weights/init_group", json=body),
                                self.pool.submit(open_group, master_address, port, 0, 1 + ranks, group_name, "gloo",
                                                 timeout_s))

    def update(self, weights, weight_version: str | None = None) -> dict:
        """Send name -> tensor (a state_dict, or pairs); returns the server's answer. The
        server checks them all against its model before it changes anything."""
        items = [(n, t.detach().contiguous().cpu()) for n, t in (weights.items() if isinstance(weights, dict)
                                                                  else weights)]
        for n, t in items:
            if dtype_name(t.dtype) not in DTYPES:
                raise ValueError(f"weight {n!r} has dtype {dtype_name(t.dtype)}; floating-point weights only "
                                 f"({', '.join(DTYPES)})")
        body = {"group_name": self.group_name, "weight_version": weight_version,
                "tensors": [{"name": n, "dtype": dtype_name(t.dtype), "shape": list(t.shape)} for n, t in items]}
        answer = self.pool.submit(self.http.post, f"{self.url}/v1/weights/update", json=body)
        sent = self.pool.submit(lambda: [self.group.broadcast(t) for _, t in items])
        self._both(answer, sent)
        return answer.result().json()

    def close(self) -> None:
        try:
            self.http.post(f"{self.url}/v1/weights/close_group", json={"group_name": self.group_name})
        finally:
            self.http.close()
            self.pool.shutdown(wait=False)

    def _both(self, http_call: Future, transfer: Future):
        """Wait for a server call and our side of the transfer; the server's refusal, or
        our side's failure, is raised as soon as it happens (the other side is abandoned:
        the group's collectives time out)."""
        done, _ = wait([http_call, transfer], return_when=FIRST_COMPLETED)
        if http_call in done:
            self._check(http_call.result())
        else:
            transfer.result()
        self._check(http_call.result())
        return transfer.result()

    @staticmethod
    def _check(response) -> dict:
        if response.status_code != 200:
            raise RuntimeError(f"the server refused ({response.status_code}): {response.text}")
        return response.json()
