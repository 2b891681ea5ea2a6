"""Kernels: the arithmetic that runs where PyTorch has no one-pass op.

Owns the native CPU library (the C++ sources beside these modules, built once per machine by
``python -m ramflow.build_kernels`` and loaded lazily), the one-pass AdamW and lean steps over
flat host buffers, Muon's host passes, the Triton kernels of the device steps and of the
int8 dequantize, and the counter-based random bits of stochastic rounding.

May import: ``ramflow.sizes`` only. Everything else in ramflow sits above this folder.
"""
