"""Fused kernels for the CUDA step and the backend's choice of them (docs/kernels.md).

- `paths.py`: the operations, their implementations and `KernelPaths` (torch-free; what the
  provenance, the receipt and the checkpoints record).
- `choice.py`: the choice at model load (`choose_kernel_paths`) and `use_kernel_paths`.
- `agreement.py`: each kernel against the torch reference at the model's widths.
- `rms_norm.py`, `gated_norm.py`, `swiglu.py`, `causal_conv.py`: the Triton kernels, forward and
  backward, as `torch.autograd.Function`s; `layout.py`: how they see their tensors.

Importing the package imports neither torch nor Triton; the kernel modules import Triton, and
only the modules a chosen path runs are imported.
"""
