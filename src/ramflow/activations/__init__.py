"""Activations: activation checkpointing (recompute a unit's forward in backward), sending a
checkpointed unit's boundary activations to pinned host memory, and the activation report
that sizes them. The engine applies these per unit; ``ramflow.memory`` exports them.

May import: ``planner``, ``transfer``, ``io``, ``units``, ``formats``, ``kernels``,
``ramflow.sizes``.
"""
