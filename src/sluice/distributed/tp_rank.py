"""A tensor-parallel rank's process: `python -m sluice.distributed.tp_rank RANK SIZE PORT`,
the engine's config and the model's spec (registry.model_spec) pickled on stdin
(distributed/tensor_parallel.py starts it). It builds its shard (worker/shard.py) and runs
the commands rank 0 broadcasts."""
import logging
import pickle
import sys

import torch

from sluice.distributed.tensor_parallel import TPGroup, plan_from_inputs, threads_per_rank
from sluice.worker.shard import build_shard

logger = logging.getLogger(__name__)


def _worker_main(rank: int, size: int, port: int, config, spec) -> None:
    """A rank other than 0: load its shard, then run the commands rank 0 broadcasts."""
    torch.set_num_threads(threads_per_rank(size))
    group = TPGroup("127.0.0.1", port, rank, size)
    group.connect()
    try:
        shard = build_shard(config, group, spec)
    except Exception as e:  # reported to rank 0, which raises it
        logger.exception("tensor-parallel rank %d failed to start", rank)
        group.store.set(f"ready{rank}", f"{type(e).__name__}: {e}")
        return
    group.store.set(f"ready{rank}", "ok")
    runner = shard.runner
    while True:
        try:
            command = group.broadcast_object()
        except RuntimeError:  # rank 0 is gone (its connections closed): so is the engine
            logger.warning("tensor-parallel rank %d: rank 0 went away; exiting", rank)
            return
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


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tp{sys.argv[1]} %(name)s: %(message)s")
    _worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *pickle.loads(sys.stdin.buffer.read()))
