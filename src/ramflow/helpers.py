"""Converting existing models: ``replace_linear`` swaps ``nn.Linear`` layers for
``ramflow.Linear`` ones that keep their weights in CPU RAM; ``fuse_lora`` computes PEFT's
LoRA layers without the elementwise passes around their rank-r update."""

from .layers.linear import replace_linear
from .layers.lora_fused import fuse_lora, unfuse_lora

__all__ = ["fuse_lora", "replace_linear", "unfuse_lora"]
