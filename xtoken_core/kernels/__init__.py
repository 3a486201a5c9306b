"""Triton kernels of the losses, each with its PyTorch reference (the CPU fallback where Triton or
CUDA is missing); the losses import the modules they use (xtoken_core/losses/fused.py)."""
