"""Kiln's fused Triton kernels and the names of the kernel paths (docs/kernels.md).

- `paths.py`: the operations, their implementations and `KernelPaths` (torch-free; what the
  provenance, the receipt and the checkpoints record).
- `rms_norm.py`, `gated_norm.py`, `swiglu.py`, `causal_conv.py`: the Triton kernels, forward and
  backward, as `torch.autograd.Function`s; `layout.py`: how they see their tensors.
- `toolchain.py`: what the installed Triton and flash-linear-attention can run (no GPU needed).

This folder stands below `model/`: it imports nothing else of kiln_train. The backend's choice
of paths, which checks each kernel against the model's torch reference, is
`kiln_train/model/kernel_choice.py` (with `kernel_agreement.py`). Importing the package imports
neither torch nor Triton; the kernel modules import Triton, and only the modules a chosen path
runs are imported.
"""
