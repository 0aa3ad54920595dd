"""A tensor-parallel rank's process: `python -m sluice.distributed.tp_rank RANK SIZE PORT`,
the engine's config pickled on stdin (distributed/tensor_parallel.py starts it)."""
import logging
import pickle
import sys

from sluice.distributed.tensor_parallel import _worker_main

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tp{sys.argv[1]} %(name)s: %(message)s")
    _worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), pickle.loads(sys.stdin.buffer.read()))
