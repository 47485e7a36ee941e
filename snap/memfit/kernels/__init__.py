"""Triton kernels, one file per op family. Each file holds a PyTorch reference, the
Triton kernel(s) with a launcher, and the public op registered as a torch custom op.
See ``dispatch`` for how a path is chosen."""
