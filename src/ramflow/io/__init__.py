"""Loading: filling a model built on the meta device from a state dict, safetensors files or
an initializer, unit by unit, without a full-precision copy of the model.

May import: ``units``, ``formats``, ``kernels``, ``ramflow.sizes``.
"""
