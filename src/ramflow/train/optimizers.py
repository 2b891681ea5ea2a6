"""The optimizers ``ramflow train --optimizer`` builds, and their default settings.

Each is a ``ramflow.optim`` optimizer (stepped on the host, overlapped with the GPU).
The CLI's ``--lr`` and ``--weight-decay`` default to AdamW's values for the preset (or
model folder) scaled per optimizer (``OPTIMIZER_DEFAULTS``); other settings are each
optimizer's published defaults.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import optim


class OptimizerDefaults(NamedTuple):
    """How an optimizer's CLI defaults follow AdamW's.

    Attributes:
        lr_scale: the default peak LR is AdamW's (the preset's) times this.
        weight_decay: the default weight decay of matrices (norm weights and biases get
            none).
        num_states: fp32 state tensors per trained parameter, for the memory estimate
            (``estimate_memory``'s ``optimizer_states``). Adafactor counts 0: its factored
            statistics are ``rows + cols`` numbers per matrix, and only vectors (norms,
            biases: well under 1% of a language model) keep a full one.
    """

    lr_scale: float
    weight_decay: float
    num_states: int


OPTIMIZER_DEFAULTS = {
    "adamw": OptimizerDefaults(lr_scale=1.0, weight_decay=0.1, num_states=2),
    # Chen et al. 2023, section 5 (and lucidrains/lion-pytorch's README): an LR 3-10x
    # smaller than AdamW's and a weight decay 3-10x larger, so that lr * wd, the strength
    # of the decay, stays; the low end of the range suits short runs.
    "lion": OptimizerDefaults(lr_scale=1 / 3, weight_decay=0.3, num_states=1),
    # torch.optim.Adafactor's LR caps a step relative to the weights' RMS; 5x the tiny
    # preset's 2e-3 is its default (and the paper's constant), 1e-2. Its weight decay is
    # scaled by that LR, so torch's default, none.
    "adafactor": OptimizerDefaults(lr_scale=5.0, weight_decay=0.0, num_states=0),
    # Plain SGD steps by the gradient itself, not a normalised one: 10x AdamW's LR with
    # momentum 0.9 (torch.optim.SGD's L2 weight decay is coupled: none by default).
    "sgd": OptimizerDefaults(lr_scale=10.0, weight_decay=0.0, num_states=1),
    # Moonlight's Muon (Liu et al. 2025) scales its update to AdamW's RMS, so AdamW's LR
    # and weight decay carry over (their recipe); the embeddings, head and vectors are
    # AdamW's. States: the hidden matrices keep one (the momentum), the rest AdamW's two;
    # the estimate counts a whole number per parameter, so 2, an upper bound.
    "muon": OptimizerDefaults(lr_scale=1.0, weight_decay=0.1, num_states=2),
}
OPTIMIZERS = tuple(OPTIMIZER_DEFAULTS)

SGD_MOMENTUM = 0.9
LION_BETAS = (0.9, 0.99)  # the paper's defaults


def make_optimizer(
    name: str,
    groups: list[dict[str, Any]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    overlap: bool,
    keep_grads: bool = True,
    clips: bool = False,
) -> torch.optim.Optimizer:
    """The ``ramflow.optim`` optimizer ``name`` over param ``groups`` (each with its
    ``weight_decay``) at peak ``lr``. ``betas`` and ``eps`` are AdamW's (``--beta1``,
    ``--beta2``, ``--eps``); Lion takes the paper's betas, Adafactor and SGD have none;
    Muon takes them for its AdamW groups, and its groups must say ``use_muon``
    (``ramflow.optim.muon_param_groups``: the trainer's ``_param_groups``).
    ``overlap`` is the optimizers'; ``keep_grads`` and ``clips`` AdamW's (``keep_grads=False``:
    the loop never reads ``p.grad``, so steps during backward write no full gradient buffer;
    ``clips``: the loop clips, so its steps hold compact gradients, see [Note: the gradients
    of a CLI step] in ``gradient_holding.py``).

    Raises:
        ValueError: ``name`` is not one of ``OPTIMIZERS``.
    """
    if name == "adamw":
        return optim.AdamW(
            groups,
            lr=lr,
            betas=betas,
            eps=eps,
            overlap=overlap,
            keep_grads=keep_grads,
            clips=clips,
        )
    if name == "lion":
        return optim.Lion(groups, lr=lr, betas=LION_BETAS, overlap=overlap)
    if name == "adafactor":
        return optim.Adafactor(groups, lr=lr, overlap=overlap)
    if name == "sgd":
        return optim.SGD(groups, lr=lr, momentum=SGD_MOMENTUM, overlap=overlap)
    if name == "muon":
        return optim.Muon(groups, lr=lr, adamw_betas=betas, adamw_eps=eps, overlap=overlap)
    raise ValueError(f"--optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")


__all__ = ["OPTIMIZERS", "OPTIMIZER_DEFAULTS", "OptimizerDefaults", "make_optimizer"]
