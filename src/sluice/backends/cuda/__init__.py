"""The CUDA backend: backend.py, the Triton kernels (attention.py: paged attention and the
K/V write; ops.py: norms and SwiGLU) and CUDA graphs (graphs.py)."""
