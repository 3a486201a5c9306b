"""Triton kernels of the losses, each with its PyTorch reference (the CPU fallback where Triton or
CUDA is missing); each mode's kernel path (xtoken_core/losses/modes/) and the shared kernel
plumbing (xtoken_core/losses/fused.py) import the modules they use."""
