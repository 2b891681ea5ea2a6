"""Hugging Face's ``Trainer`` on the one-weight-pass schedule: ``UnitMajorTrainer``.

With ``gradient_accumulation_steps=M`` the ``Trainer`` calls ``training_step`` once per
micro-batch, so each offloaded unit's weights cross PCIe M times in forward and M times in
backward per optimizer step, and the step waits for a full host gradient buffer.
``UnitMajorTrainer`` (or ``UnitMajorTrainerMixin`` in front of another ``Trainer``
subclass, TRL's ``SFTTrainer``) runs the window's micro-batches through
``ramflow.accumulate`` instead: each unit loads once for forward and once for backward per
step, and its gradient crosses D2H once, when complete. docs/hf-trainer.md has the user's
side.

[Note: the Trainer's micro-batches in one call]
transformers 5.x's ``Trainer._run_epoch`` gathers each optimizer step's micro-batches with
``get_batch_samples`` (the window: M batches and ``num_items_in_batch``), then calls
``training_step(model, inputs, num_items_in_batch)`` for each, then clips
(``max_grad_norm``), steps the optimizer and the LR schedule, logs, saves and evaluates.
The mixin overrides the two methods only, and the loop stays the ``Trainer``'s own:

- ``get_batch_samples`` keeps the window it returns.
- ``training_step`` called with the window's first batch runs ``ramflow.accumulate`` over
  the whole window, where each micro-batch's loss comes from the ``Trainer``'s own
  ``training_step`` (``super()``'s: ``compute_loss``, the loss scaling by
  ``num_items_in_batch`` or by M, a subclass's ``compute_loss``), with the accelerator's
  ``backward`` swapped, for that call only, for one that keeps the tensor it would
  backward (accelerate's ``backward`` divides by its ``gradient_accumulation_steps``, which
  the ``Trainer`` sets to 1, and calls ``loss.backward()``: the kept tensor is that
  quotient; ``ramflow.accumulate`` runs the backward, unit-major). It returns the first
  micro-batch's loss; the later calls return theirs (matched by identity with the
  window's batches) without computing anything. So the logged loss, ``num_input_tokens``,
  the FLOPs and every callback see what the plain ``Trainer`` gives them, in its order;
  only the work of micro-batches 1..M-1 happens in micro-batch 0's call.

A window of one batch (M=1, an epoch's last short window) runs ``training_step`` as it is:
one batch has nothing to gain. Where the unit-major order cannot run, the mixin warns once
(one line: why) and trains as the plain ``Trainer`` does (``_why_not_unit_major``).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import ramflow
from ramflow.optim import HostOptimizer

try:
    from transformers import Trainer
    from transformers.training_args import OptimizerNames
except ImportError as err:  # pragma: no cover - the hf extra is missing
    raise ImportError(
        "ramflow.train.UnitMajorTrainer needs transformers and accelerate "
        "(pip install 'ramflow[hf]' accelerate)"
    ) from err


class UnitMajorTrainerMixin:
    """Put it before a ``transformers.Trainer`` (sub)class to run each optimizer step's
    micro-batches unit-major (``ramflow.accumulate``): with ``gradient_accumulation_steps=M``
    an offloaded unit's weights cross PCIe twice per optimizer step instead of 2M times,
    and its gradient is complete, and may be stepped, when the last micro-batch's backward
    leaves it. See [Note: the Trainer's micro-batches in one call].

    Everything else is the ``Trainer``'s: loss scaling (``num_items_in_batch``), logging,
    ``max_grad_norm``, LR schedules, callbacks, evaluation and checkpoints. The gradients
    equal the plain ``Trainer``'s up to the order of summation (bit for bit on the CPU in
    fp32). Where it cannot run unit-major (data parallel, DeepSpeed, FSDP, context or
    tensor parallel, fp16 with a loss scaler, LOMO, a model not offloaded by
    ``ramflow.offload``, an optimizer not from ``ramflow.optim``) it warns once and trains as the plain ``Trainer`` does.

    Example::

        class SFT(UnitMajorTrainerMixin, trl.SFTTrainer): ...

    Raises:
        RuntimeError: from ``train``, as ``ramflow.accumulate`` (a micro-batch's forward
            raised, named by its index; the micro-batches made different unit calls; a
            tensor reaches the loss past a unit's outputs), or a ``training_step`` of a
            subclass that does not call ``self.accelerator.backward``.
    """

    _ramflow_window: list[Any] | None = None  # the optimizer step's batches
    _ramflow_losses: list[torch.Tensor] | None = None  # their losses, once computed
    _ramflow_why_not: str | None = None  # checked once, at the first window of several
    _ramflow_checked = False

    def get_batch_samples(
        self, epoch_iterator: Iterator, num_batches: int, device: torch.device
    ) -> tuple[list, torch.Tensor | int | None]:
        """The ``Trainer``'s, keeping the window for ``training_step``."""
        batch_samples, num_items_in_batch = super().get_batch_samples(  # type: ignore[misc]
            epoch_iterator, num_batches, device
        )
        self._ramflow_window = list(batch_samples)
        self._ramflow_losses = None
        return batch_samples, num_items_in_batch

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """The ``Trainer``'s ``training_step``, unit-major over the window: the call with
        its first batch runs forward and backward of every batch in it; each call returns
        its batch's loss (detached, scaled as the ``Trainer`` scales it)."""
        window = self._ramflow_window or []
        index = next((i for i, b in enumerate(window) if b is inputs), None)
        if index is None or len(window) < 2 or self._why_not_unit_major(model) is not None:
            return super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        if index == 0:
            self._ramflow_losses = None  # a failed call leaves nothing for the others
            self._ramflow_losses = self._unit_major_window(model, window, num_items_in_batch)
        if self._ramflow_losses is None:
            raise RuntimeError(
                f"training_step was called with micro-batch {index} of the step before "
                "micro-batch 0: UnitMajorTrainer computes a step's micro-batches when it "
                "sees the first; call training_step in the window's order"
            )
        return self._ramflow_losses[index]

    def _unit_major_window(
        self,
        model: nn.Module,
        window: list[Any],
        num_items_in_batch: torch.Tensor | int | None,
    ) -> list[torch.Tensor]:
        """Forward and backward of every batch of ``window`` through ``ramflow.accumulate``,
        each loss from ``super().training_step``; returns what each of those returned."""
        step = super().training_step  # type: ignore[misc]
        kept = threading.local()  # accumulate runs each micro-batch in its own thread
        returned: list[torch.Tensor | None] = [None] * len(window)

        def keep(loss: torch.Tensor, **kwargs: Any) -> None:
            if kwargs:  # the Trainer passes some only for DeepSpeed and LOMO, refused
                raise RuntimeError(f"unexpected accelerator.backward arguments {sorted(kwargs)}")
            kept.loss = loss / self.accelerator.gradient_accumulation_steps

        def loss_fn(item: tuple[int, Any]) -> torch.Tensor:
            m, inputs = item
            kept.loss = None
            returned[m] = step(model, inputs, num_items_in_batch)
            if kept.loss is None:
                raise RuntimeError(
                    f"{type(self).__name__}.training_step returned without calling "
                    "self.accelerator.backward(loss): UnitMajorTrainerMixin takes the loss "
                    "there. Call it in that training_step instead of loss.backward(), or "
                    "train with the plain Trainer"
                )
            return kept.loss

        with _backward_swapped(self.accelerator, keep):
            ramflow.accumulate(model, list(enumerate(window)), loss_fn)
        return returned  # type: ignore[return-value]

    def _why_not_unit_major(self, model: nn.Module) -> str | None:
        """Why this run cannot go unit-major (None: it can), decided once; the first
        reason found is warned, in one line."""
        if not self._ramflow_checked:
            self._ramflow_checked = True
            self._ramflow_why_not = _why_not(self, model)
            if self._ramflow_why_not is not None:
                warnings.warn(
                    f"{type(self).__name__}: {self._ramflow_why_not}; the micro-batches run one "
                    "after another, as in the plain Trainer",
                    stacklevel=3,
                )
        return self._ramflow_why_not


class UnitMajorTrainer(UnitMajorTrainerMixin, Trainer):
    """``transformers.Trainer`` that runs each optimizer step's micro-batches unit-major;
    see ``UnitMajorTrainerMixin``. Built and used as a ``Trainer``::

        model = ramflow.offload(model, gpu_memory="12GiB")
        trainer = UnitMajorTrainer(model=model, args=args, train_dataset=ds,
                                   optimizer_cls_and_kwargs=(ramflow.optim.AdamW, {"lr": 2e-5}))
        trainer.train()
    """


def _why_not(trainer: Any, model: nn.Module) -> str | None:
    """The first reason ``trainer`` cannot run ``model``'s micro-batches unit-major, or
    None. Each is a case ``ramflow.accumulate`` refuses, or one whose backward is not a
    plain ``loss.backward()`` (a loss scaler, DeepSpeed, LOMO)."""
    from accelerate.utils import DistributedType

    accelerator = trainer.accelerator
    if accelerator.distributed_type != DistributedType.NO or trainer.args.n_gpu > 1:
        return (
            f"ramflow.accumulate does not run data parallel or sharded "
            f"({accelerator.distributed_type.value}, {trainer.args.n_gpu} GPUs) yet"
        )
    if max(trainer.get_cp_size(), trainer.get_sp_size(), trainer.get_tp_size()) > 1:
        return "ramflow.accumulate does not run context, sequence or tensor parallel"
    if accelerator.scaler is not None:
        return "fp16 with a loss scaler is not supported unit-major (use bf16)"
    if trainer.args.optim in (OptimizerNames.LOMO, OptimizerNames.ADALOMO):
        return "LOMO optimizers step inside backward and are not supported"
    if not ramflow.is_offloaded(model):
        return "the model is not offloaded by ramflow.offload"
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if not isinstance(optimizer, HostOptimizer):
        return (
            f"the optimizer is {type(optimizer).__name__}, not a ramflow.optim one "
            "(pass optimizer_cls_and_kwargs=(ramflow.optim.AdamW, {...}))"
        )
    return None


@contextlib.contextmanager
def _backward_swapped(accelerator: Any, keep: Any) -> Iterator[None]:
    """``accelerator.backward`` is ``keep`` inside the block, as it was after it. See
    [Note: the Trainer's micro-batches in one call]."""
    own = vars(accelerator).get("backward")  # an instance attribute someone set, or None
    accelerator.backward = keep
    try:
        yield
    finally:
        if own is None:
            del accelerator.backward
        else:
            accelerator.backward = own
