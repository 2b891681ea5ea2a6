"""Layers: ``ramflow.Linear`` (one linear layer whose weights live in host RAM, streamed per
call, for models built layer by layer as RamTorch's are) and PeFT's LoRA layers fused into
one frozen matmul and a rank-r update.

May import: ``engine`` and everything below it.
"""
