"""Host formats: how master weights, optimizer states, gradients and frozen weights are kept
in host RAM, and each format's AdamW arithmetic.

Owns ``HostPrecision`` and its presets (fp32, bf16, lean), their byte model (the one that
the planner, the estimate and checkpoints use), the compressed frozen formats (int8, NF4),
the reading of older state layouts, and the per-format step (host or device). Nothing
outside this folder branches on a format's name.

May import: ``kernels``, ``ramflow.sizes``.
"""
