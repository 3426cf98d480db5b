"""Triton kernels, each with a plain-torch reference of the same signature."""
