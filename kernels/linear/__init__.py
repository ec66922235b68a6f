"""Row-invariant bf16 projections on CPU: `linear` (prepacked weight) and `bmm`, the contract and reference in
`naive.py`, the C++ kernel in `cpu_kernel.py` (used by `kernels.batch_invariant` when it is built)."""
