"""Beyond one process: tensor parallelism on torch.distributed (parallel.py,
tensor_parallel.py), weight updates from a trainer's process group (weight_sync.py), and
data-parallel replicas on Ray behind a cache-aware router (entrypoints/router/)."""
