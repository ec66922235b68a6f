import os

# Triton kernels run on CPU tensors under Triton's interpreter in tests (CI has no GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")
