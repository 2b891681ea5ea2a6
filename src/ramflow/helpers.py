"""Converting existing models: ``replace_linear`` swaps ``nn.Linear`` layers for
``ramflow.Linear`` ones that keep their weights in CPU RAM."""

from ._linear import replace_linear

__all__ = ["replace_linear"]
