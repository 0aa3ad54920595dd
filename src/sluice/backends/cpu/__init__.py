"""The CPU backend: backend.py decides, per ISA family (x86/ now; ARM would be a folder
beside it), which of our C++ kernels or torch's ops runs each op."""
