"""Triton kernels of the losses, each with its PyTorch reference (the CPU fallback where Triton or
CUDA is missing); each mode's kernel path (xtoken_core/losses/modes/) and the kernel backend
(xtoken_core/losses/backends/kernel.py) import the modules they use."""
