"""The planner: what an offloaded run will use and how long its step takes.

Owns the offload plan (residents, window depth, device-optimizer choice, host bytes), the
step-time model and its list scheduler, and the per-unit costs read from a model's shapes.
Its figures are promises: the engine sizes real budgets with them and ``ramflow plan``
prints them.

May import: ``transfer``, ``io``, ``units``, ``formats``, ``kernels``, ``ramflow.sizes``.
"""
