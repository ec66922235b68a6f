"""Row norms (RMSNorm, LayerNorm, L2) and rotary embeddings: the PyTorch forms in `naive.py`, one C++ op each on
CPU in `cpu_kernel.py` (what `expertmesh.model.transformer` runs there when the kernel is built)."""
