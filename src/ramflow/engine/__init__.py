"""The streaming engine of one offloaded model: its coordinator and parts.

Owns the host store (masters, wire copies, gradient staging), the device window (slots,
residents, evictions), the schedule (forward and backward hooks, prefetch), the gradient
path (device buffers, D2H, landing), the stepper and its step policy, the host worker
thread, clipping and gradient norms, adapters kept on the device, the loading of routed
experts by the router's choice, and the hooks for plain ``torch.optim`` optimizers. See docs/design.md for the picture.

May import: ``activations``, ``planner``, ``transfer``, ``io``, ``units``, ``formats``,
``kernels``, ``ramflow.sizes``.
"""
