"""Host formats: how master weights, optimizer states and gradients are kept in host RAM.

Each format is an object that owns its layout and its arithmetic (as torchao's
``OptimState8bit`` owns its code and block size): ``MasterFormat`` (the master weights: dtype,
whether it is the wire copy, a compensation), ``StateFormat`` (AdamW's states: dtype, block,
state tensors and their views) and ``GradientFormat`` (host gradients: one per unit, or a
ring). ``HostPrecision`` is the policy that names one of each; it answers every question the
store, the optimizer, the planner, the estimate and the checkpoint ask (``host_bytes`` is the
one byte model), so nothing outside this module branches on a format's name. To add a format,
add one object to ``MASTERS``, ``OPTIMIZER_STATES`` or ``GRADIENTS`` (and its kernel to
``kernels.lean_kernels``). ``kernels.lean_kernels`` steps the formats on the CPU. See docs/design-host.md, "Host
formats", for what each stores and why stochastic rounding needs a counter-based generator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from ..choices import HOST_PRECISION_PRESETS
from ..kernels.lean_kernels import QBLOCK, dequantize_blockwise, quantize_blockwise
from .deferred_grad import compact_nbytes
from .frozen import compressed_nbytes
from .legacy_states import LEGACY_BLOCK, has_legacy_moments, is_legacy_name, pop_legacy_moments
from .states_4bit import BLOCK_4BIT, STEP_CHUNK, dequantize_4bit, quantize_4bit, zero_code

__all__ = ["HostPrecision", "check_optimizer_formats"]

# fp32 master weights, exp_avg and exp_avg_sq of a unit stepped on the device
DEVICE_STEP_BYTES_PER_PARAM = 12
# elements per piece of a device step (the gradient is upcast to fp32 one piece at a time)
DEVICE_STEP_PIECE = 16 * 2**20
DEVICE_STEP_SCRATCH_BYTES = DEVICE_STEP_PIECE * 4
# a lean unit's device step without Triton runs the host kernel's arithmetic in PyTorch
# ops: its fp32 and int64 temporaries take about 96 bytes per element of a piece. With
# Triton (one kernel, no temporaries) a piece is DEVICE_STEP_PIECE elements and its only
# scratch is a host gradient's upload (4 bytes each), within this reserve
LEAN_DEVICE_STEP_PIECE = 2 * 2**20
LEAN_DEVICE_STEP_SCRATCH_BYTES = LEAN_DEVICE_STEP_PIECE * 96
# staging buffers of the gradient ring, see [Note: the gradient ring] in ``engine.host_store``
RING_BUFFERS = 4
# a step cut in pieces (the refresh's, a device step's) starts each piece on a multiple of
# this many elements: whole blocks of the 8-bit states, and a parameter's start
# (``units.unit.ALIGN``), so each piece rounds and quantizes as the whole unit would
STEP_ALIGN = QBLOCK

# AdamW's moments, in every state format
MOMENTS = ("exp_avg", "exp_avg_sq")
# Optimizers with a CPU kernel for each format; the fp32 formats go with every optimizer.
_LEAN_OPTIMIZERS = ("adamw", "lion")


def _choices(values: Iterable[str]) -> str:
    return ", ".join(repr(v) for v in values)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class MasterFormat:
    """How a trained parameter's master weights are kept in host RAM.

    Attributes:
        name: ``HostPrecision.master``'s value.
        dtype: the master's dtype (that of its host gradients too).
        is_wire: the master is the wire copy itself (a step writes it in place and the
            refresh is only the H2D copy); it then needs a wire of its ``dtype``.
        compensated: a compensation buffer in ``dtype`` holds what rounding dropped
            (Kahan summation); the optimizer keeps it with its states, as
            ``COMPENSATION``.
        exact: steps are PyTorch's fp32 arithmetic (else stochastic or compensated
            rounding of the lean kernel).
    """

    name: str
    dtype: torch.dtype
    is_wire: bool
    compensated: bool = False
    exact: bool = False

    COMPENSATION = "master_compensation"

    def wire_copy_bytes(self, wire_dtype: torch.dtype) -> int:
        """Bytes per element of a separate wire copy beside the master (0 when the master
        is the wire copy, or the wire is the master's own dtype)."""
        return 0 if self.is_wire or wire_dtype == self.dtype else _size(wire_dtype)

    @property
    def state_names(self) -> tuple[str, ...]:
        """Tensors the optimizer keeps for the master (a compensation), per parameter."""
        return (self.COMPENSATION,) if self.compensated else ()

    @property
    def state_bytes_per_parameter(self) -> float:
        return float(_size(self.dtype)) if self.compensated else 0.0

    @property
    def device_step_bytes_per_parameter(self) -> float:
        """Device bytes of the master of a unit stepped on the device: none when the
        master is the unit's device copy, else its own copy."""
        return 0.0 if self.is_wire else float(_size(self.dtype))


@dataclass(frozen=True)
class StateFormat:
    """How AdamW's states (``exp_avg``, ``exp_avg_sq``) are kept in host RAM.

    Attributes:
        name: ``HostPrecision.optimizer_states``' value.
        dtype: the stored elements' dtype (``torch.uint8`` for 8-bit codes).
        block: elements per block with one fp32 power-of-two scale (8-bit FP8 E4M3 codes,
            see [Note: 8-bit states in FP8 with power-of-two block scales] in
            ``kernels.lean_kernels``), None for a plain dtype. The kernels take it from here
            (``kernels.lean_kernels.QBLOCK`` is the one they are built for).
    """

    name: str
    dtype: torch.dtype
    block: int | None = None

    @property
    def exact(self) -> bool:
        """fp32 states: PyTorch's own AdamW steps them."""
        return self.dtype == torch.float32

    SCALE = "_scale"  # suffix of a moment's per-block scale

    @property
    def state_names(self) -> tuple[str, ...]:
        """The moments and, for block-wise codes, their scales."""
        scales = tuple(m + self.SCALE for m in MOMENTS) if self.block else ()
        return MOMENTS + scales

    def bytes_per_parameter(self, num_states: int = len(MOMENTS)) -> float:
        """Bytes per trained parameter of ``num_states`` states (AdamW's two), with the
        scale of block-wise codes (4 bytes per block)."""
        per = _size(self.dtype) + (4 / self.block if self.block else 0)
        return num_states * per

    def numel(self, name: str, n: int) -> int:
        """Elements of state ``name`` for ``n`` parameter elements."""
        return -(-n // self.block) if self.block and name.endswith(self.SCALE) else n

    def view(self, name: str, flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """State ``name``'s part for elements ``lo:hi`` of its flat buffer ``flat``; ``lo``
        starts a block (``STEP_ALIGN``)."""
        if self.block and name.endswith(self.SCALE):
            return flat[lo // self.block : -(-hi // self.block)]
        return flat[lo:hi]

    def encode(self, name: str, value: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        """Write moment ``name``'s fp32 ``value`` (n,) into its host ``views`` in this format:
        block-wise codes with their scales, or the dtype's rounding."""
        if self.block:
            codes, scale = quantize_blockwise(value, signed=name == "exp_avg")
            views[name].copy_(codes.view_as(views[name]))
            views[name + self.SCALE].copy_(scale)
        else:
            views[name].copy_(value.view_as(views[name]))

    def decode(self, name: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Moment ``name`` of one parameter's ``state`` in this format as values (its scale
        taken out of ``state``)."""
        value = state[name]
        if self.block:
            scale = state.pop(name + self.SCALE)
            return dequantize_blockwise(value.reshape(-1), scale, signed=name == "exp_avg")
        return value

    def moment_names(self, moment: str) -> tuple[str, ...]:
        """The state tensors that hold ``moment`` (one of ``MOMENTS``): itself, and its
        scale when block-wise."""
        return (moment, moment + self.SCALE) if self.block else (moment,)

    step_chunk: int | None = None
    """Elements a step takes at once (formats whose moments the kernel reads decoded);
    None: a piece whole."""

    @property
    def kernel_dtype(self) -> torch.dtype:
        """The states' dtype as the lean kernel reads them (``lean_adamw_step_``)."""
        return self.dtype

    def kernel_moments(self, views: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
        """The lean kernel's state arguments (``exp_avg``, ``exp_avg_sq`` and, block-wise,
        their scales) for ``n`` elements whose states are ``views``: the views themselves,
        which the kernel steps in place (``store_moments`` has nothing to do)."""
        return {name: views[name] for name in self.state_names}

    def store_moments(
        self, views: dict[str, torch.Tensor], moments: dict[str, torch.Tensor]
    ) -> None:
        """After the kernel stepped ``kernel_moments``' tensors: write them into ``views``
        (nothing here: they were the views)."""

    def new(self, name: str, n: int) -> torch.Tensor:
        """State ``name`` for ``n`` elements, at zero: codes of zero (any scale reads them
        as zero; a step writes its own)."""
        if self.block and name.endswith(self.SCALE):
            return torch.zeros(self.numel(name, n), dtype=torch.float32)
        if self.block:
            # every element of an all-zero block has the same code: quantize one block and
            # fill. Quantizing n zeros made about 18 transient bytes per element (the fp32
            # zeros, their padded and scaled copies, int64 bucket indices): 14 GB for the
            # 778M-element embedding of a 14B model, on top of the store, at the first step
            zero, _ = quantize_blockwise(torch.zeros(self.block), signed=name == "exp_avg")
            return torch.full((n,), int(zero[0]), dtype=zero.dtype)
        return torch.zeros(n, dtype=self.dtype)


@dataclass(frozen=True)
class FourBitStateFormat(StateFormat):
    """AdamW's states in 4 bits per element with one fp32 absmax per block of 128 (Li et
    al. 2023, torchao's ``AdamW4bit``): see [Note: 4-bit AdamW states] in
    ``formats.states_4bit``. A moment's codes are ``<moment>_4bit`` (uint8, two per byte:
    half as many bytes as elements) and its absmax ``<moment>_4bit_scale``; names of their
    own, so that a checkpoint's states say their format (``saved_state_shape``)."""

    CODES = "_4bit"
    SCALE = "_4bit_scale"

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(m + self.CODES for m in MOMENTS) + tuple(m + self.SCALE for m in MOMENTS)

    def moment_names(self, moment: str) -> tuple[str, ...]:
        return (moment + self.CODES, moment + self.SCALE)

    def bytes_per_parameter(self, num_states: int = len(MOMENTS)) -> float:
        """Half a byte per element of each state, plus 4 bytes per block of 128."""
        return num_states * (0.5 + 4 / BLOCK_4BIT)

    @property
    def kernel_dtype(self) -> torch.dtype:
        return torch.float32

    def numel(self, name: str, n: int) -> int:
        """Blocks for a scale; half a block's elements per block for codes (whole blocks:
        see [Note: 4-bit AdamW states])."""
        blocks = -(-n // BLOCK_4BIT)
        return blocks if name.endswith(self.SCALE) else blocks * BLOCK_4BIT // 2

    def view(self, name: str, flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """The blocks that cover ``lo:hi``; ``lo`` starts a block (``STEP_ALIGN``)."""
        blocks = slice(lo // BLOCK_4BIT, -(-hi // BLOCK_4BIT))
        if name.endswith(self.SCALE):
            return flat[blocks]
        return flat[blocks.start * BLOCK_4BIT // 2 : blocks.stop * BLOCK_4BIT // 2]

    def encode(self, name: str, value: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        codes, absmax = quantize_4bit(value, signed=name == "exp_avg")
        views[name + self.CODES].copy_(codes.view_as(views[name + self.CODES]))
        views[name + self.SCALE].copy_(absmax)

    def decode(self, name: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Moment ``name``'s values, its codes and absmax taken out of ``state``: whole
        blocks (the caller drops what is past its parameter's end)."""
        codes = state.pop(name + self.CODES).reshape(-1)
        absmax = state.pop(name + self.SCALE).reshape(-1)
        return dequantize_4bit(codes, absmax, 2 * codes.numel(), signed=name == "exp_avg")

    def new(self, name: str, n: int) -> torch.Tensor:
        """Codes of zero and zero absmax: every value reads as 0."""
        if name.endswith(self.SCALE):
            return torch.zeros(self.numel(name, n), dtype=torch.float32)
        code = zero_code(signed=name.startswith(MOMENTS[0] + self.CODES))
        return torch.full((self.numel(name, n),), code, dtype=torch.uint8)

    def kernel_moments(self, views: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
        """The moments of ``n`` elements decoded to fp32, for the kernel to step."""
        return {
            m: dequantize_4bit(
                views[m + self.CODES], views[m + self.SCALE], n, signed=m == "exp_avg"
            )
            for m in MOMENTS
        }

    def store_moments(
        self, views: dict[str, torch.Tensor], moments: dict[str, torch.Tensor]
    ) -> None:
        for m in MOMENTS:
            self.encode(m, moments[m], views)


@dataclass(frozen=True)
class GradientFormat:
    """How host gradients are kept.

    Attributes:
        name: ``HostPrecision.gradients``' value.
        ring: units are stepped during backward and only the units in flight hold a
            staging buffer (``RING_BUFFERS`` of the largest unit's size), borrowed from a
            ring; else a full host gradient (in the master's dtype) and a staging buffer
            (in the wire dtype) per unit.
    """

    name: str
    ring: bool

    def bytes_per_parameter(self, master: MasterFormat, wire_dtype: torch.dtype) -> float:
        """Per trained parameter: full, the master's dtype plus staging; a ring, 0 (a
        fixed cost that does not grow with the model)."""
        return 0.0 if self.ring else float(_size(master.dtype) + _size(wire_dtype))


MASTERS = {
    f.name: f
    for f in (
        MasterFormat("fp32", torch.float32, is_wire=False, exact=True),
        MasterFormat("bf16-sr", torch.bfloat16, is_wire=True),
        MasterFormat("bf16-kahan", torch.bfloat16, is_wire=True, compensated=True),
    )
}
OPTIMIZER_STATES = {
    f.name: f
    for f in (
        StateFormat("fp32", torch.float32),
        StateFormat("bf16", torch.bfloat16),
        StateFormat("fp8", torch.uint8, block=QBLOCK),
        FourBitStateFormat("4bit", torch.uint8, block=BLOCK_4BIT, step_chunk=STEP_CHUNK),
    )
}
GRADIENTS = {
    f.name: f for f in (GradientFormat("full", ring=False), GradientFormat("ring", ring=True))
}
# the 8-bit states' name before the FP8 code; HostPrecision takes it as "fp8"
LEGACY_8BIT_NAME = "int8"
# the named policies (``HostPrecision.parse``; the classmethods of the same names)


class StoredUnit(Protocol):
    """What the byte model reads of a unit (``units.unit.Unit``)."""

    kept_numel: int
    trainable_numel: int
    given_master: torch.Tensor | None
    frozen_format: str | None

    def compressed_numels(self) -> Iterable[int]: ...


class HostBytes(NamedTuple):
    """Host bytes of units under one policy, by part (``HostPrecision.host_bytes``).

    Attributes:
        master: master weights (a buffer a layer or another rank gave is not counted).
        wire: wire copies beside fp32 masters.
        compressed: frozen weights kept compressed (``frozen_format``).
        gradients: full host gradients: in the master's dtype without the ring; under the
            ring with ``host_bytes(full_gradients=True)``, the deferred gradients (below).
        staging: D2H staging in the wire dtype (per unit, or the ring's buffers).
        states: AdamW's states and a Kahan compensation (the optimizer's).
        deferred_gradients: under the gradient ring, the host gradients that a step not
            applied during backward holds from its landing to ``opt.step()``: the first
            step of an optimizer that keeps ``p.grad`` or says it clips, every step of a
            loop that clips, gradient accumulation. In 8-bit codes (``1 + 4 / 256`` bytes
            per parameter, see [Note: the compact deferred gradient] in
            ``formats.deferred_grad``) under masters that are not exact when the optimizer
            keeps no ``p.grad``, else in the master's dtype. Not in ``store`` or ``total``,
            which are a ring's steady state (the plan's ``host_bytes`` adds them); 0
            without the ring or with ``host_bytes(full_gradients=True)`` (``gradients``
            holds them).
    """

    master: int
    wire: int
    compressed: int
    gradients: int
    staging: int
    states: int
    deferred_gradients: int = 0

    @property
    def store(self) -> int:
        """The host store's bytes (what ``HostStore`` allocates): all but the states."""
        return self.master + self.wire + self.compressed + self.gradients + self.staging

    @property
    def total(self) -> int:
        return self.store + self.states


@dataclass(frozen=True)
class HostPrecision:
    """How each trained parameter is kept in host RAM (a policy, chosen once at set-up).

    Attributes:
        master: the master weights. ``"fp32"`` (default): fp32, stepped exactly as
            ``torch.optim.AdamW`` steps them, plus a separate wire copy when the wire dtype
            is not fp32. ``"bf16-sr"``: bf16, written with stochastic rounding (Zamirai et
            al. 2020); with a bf16 wire the master is the wire copy, one buffer.
            ``"bf16-kahan"``: bf16 plus a bf16 compensation buffer holding what rounding
            dropped (compensated summation, as optimi and Collage do).
        optimizer_states: the AdamW states ``exp_avg``/``exp_avg_sq``. ``"fp32"`` (default),
            ``"bf16"``, or ``"fp8"``: 8-bit FP8 E4M3 codes (of ``exp_avg`` and of
            ``sqrt(exp_avg_sq)``) with one fp32 power-of-two scale per block of 256
            elements (Fishman et al. 2025; COAT, Xi et al. 2025). bf16 and fp8 states are
            written with stochastic rounding, with any master. ``"int8"``, the name of the
            8-bit states before the FP8 code, is taken as ``"fp8"``.
        gradients: host gradients. ``"full"`` (default): a gradient buffer for the whole
            model in the master's dtype plus a staging buffer in the wire dtype; needed for
            gradient accumulation, clipping and ``keep_grads``. ``"ring"``: units are
            stepped during backward and only the units in flight hold staging, a fixed
            cost that does not grow with the model (counted as 0 bytes per parameter). A
            full buffer is still made for the steps that need one (the first,
            accumulation, clipping) and dropped once steps run during backward
            (``HostBytes.deferred_gradients``): in the master's dtype, or in 8-bit codes
            under masters that are not exact with ``AdamW(keep_grads=False)`` (see
            ``formats.deferred_grad``), whose first step runs during backward too unless
            it says it clips (``clips=True``).
        seed: the seed of the stochastic rounding (an int in [0, 2**63)); unit ``i`` rounds
            with ``unit_seed(i)``, so a run is reproducible and resumes exactly.

    Presets: ``fp32()`` (today's, 20 bytes per parameter), ``bf16()`` (bf16-sr masters,
    bf16 states, ring: 6), ``lean()`` (bf16-sr masters, 8-bit states, ring: about 4.03),
    ``kahan()`` (bf16-kahan masters, 8-bit states, ring: about 6.03). ``parse`` takes their
    names.

    Raises:
        ValueError: a field has a value not listed above (the message lists those that are).
    """

    master: str = "fp32"
    optimizer_states: str = "fp32"
    gradients: str = "full"
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"HostPrecision(seed=...) must be an int, got {self.seed!r}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"HostPrecision(seed={self.seed}) must be in [0, 2**63)")
        if self.optimizer_states == LEGACY_8BIT_NAME:  # the same slot under its old name
            object.__setattr__(self, "optimizer_states", "fp8")
        for name, value, allowed in (
            ("master", self.master, MASTERS),
            ("optimizer_states", self.optimizer_states, OPTIMIZER_STATES),
            ("gradients", self.gradients, GRADIENTS),
        ):
            if value not in allowed:
                raise ValueError(
                    f"HostPrecision({name}={value!r}) is not a format; {name} is one of "
                    f"{_choices(allowed)}"
                )

    @classmethod
    def fp32(cls) -> HostPrecision:
        """fp32 masters, fp32 states, full gradients: today's, exact."""
        return cls(master="fp32", optimizer_states="fp32", gradients="full")

    @classmethod
    def bf16(cls) -> HostPrecision:
        """bf16 masters and bf16 states, both with stochastic rounding, a gradient ring."""
        return cls(master="bf16-sr", optimizer_states="bf16", gradients="ring")

    @classmethod
    def lean(cls) -> HostPrecision:
        """bf16 masters with stochastic rounding, 8-bit states, a gradient ring."""
        return cls(master="bf16-sr", optimizer_states="fp8", gradients="ring")

    @classmethod
    def kahan(cls) -> HostPrecision:
        """bf16 masters with a bf16 compensation (Kahan), 8-bit states, a gradient ring."""
        return cls(master="bf16-kahan", optimizer_states="fp8", gradients="ring")

    @classmethod
    def lean4(cls) -> HostPrecision:
        """bf16 masters with stochastic rounding, 4-bit states (Li et al. 2023), a gradient
        ring: 3.06 bytes per trained parameter."""
        return cls(master="bf16-sr", optimizer_states="4bit", gradients="ring")

    @classmethod
    def parse(cls, value: HostPrecision | str | None) -> HostPrecision:
        """A policy from a preset's name (``"fp32"``, ``"bf16"``, ``"lean"``, ``"kahan"``,
        ``"lean4"``),
        a policy (returned as is) or None (``fp32()``).

        Raises:
            ValueError: an unknown name (the message lists the presets).
            TypeError: neither a string nor a HostPrecision.
        """
        if value is None:
            return cls.fp32()
        if isinstance(value, HostPrecision):
            return value
        if not isinstance(value, str):
            raise TypeError(
                f"host_precision must be a HostPrecision or a preset's name, got {value!r}"
            )
        if value not in HOST_PRECISION_PRESETS:
            raise ValueError(
                f"host_precision={value!r} is not a preset; use one of {_choices(HOST_PRECISION_PRESETS)} "
                "or a ramflow.HostPrecision(master=..., optimizer_states=..., gradients=...)"
            )
        return getattr(cls, value)()

    @property
    def name(self) -> str:
        """The preset's name when this policy is one (seed aside), else its fields."""
        for preset in HOST_PRECISION_PRESETS:
            p = getattr(HostPrecision, preset)()
            if (p.master, p.optimizer_states, p.gradients) == (
                self.master,
                self.optimizer_states,
                self.gradients,
            ):
                return preset
        return f"{self.master}/{self.optimizer_states}/{self.gradients}"

    @property
    def master_format(self) -> MasterFormat:
        return MASTERS[self.master]

    @property
    def state_format(self) -> StateFormat:
        return OPTIMIZER_STATES[self.optimizer_states]

    @property
    def gradient_format(self) -> GradientFormat:
        return GRADIENTS[self.gradients]

    @property
    def master_dtype(self) -> torch.dtype:
        """dtype of the host master weights (and of the host gradients)."""
        return self.master_format.dtype

    @property
    def master_is_wire(self) -> bool:
        """The master is the wire copy (a bf16 master: one buffer, stepped in place)."""
        return self.master_format.is_wire

    def unit_seed(self, index: int) -> int:
        """The stochastic rounding's seed of unit ``index``: the policy's seed mixed with it."""
        return (self.seed * 0x9E3779B97F4A7C15 + index + 1) % 2**64

    @property
    def spelled(self) -> str:
        """This policy as a user writes it: ``host_precision='lean'`` for a preset (seed
        aside), else ``HostPrecision(master=..., optimizer_states=..., gradients=...)``; for
        error messages."""
        if "/" not in self.name:
            return f"host_precision={self.name!r}"
        return (
            f"HostPrecision(master={self.master!r}, optimizer_states="
            f"{self.optimizer_states!r}, gradients={self.gradients!r})"
        )

    def wire_for(self, wire_dtype: torch.dtype | None, *, default: torch.dtype) -> torch.dtype:
        """The wire dtype of a run: ``wire_dtype`` when the user gave one, else the
        master's own when the master is the wire copy (bf16), else ``default`` (the
        device's: bf16 on CUDA, fp32 on the CPU)."""
        if wire_dtype is not None:
            return wire_dtype
        return self.master_dtype if self.master_is_wire else default

    def check_wire(self, wire_dtype: torch.dtype) -> None:
        """Raise ValueError when these masters cannot serve a wire copy of ``wire_dtype``.

        A bf16 master is the wire copy itself, so it needs a bf16 wire: an fp32 wire would
        send twice the bytes with no more precision than the master has, an fp16 wire
        would be a second copy that loses bf16's range on every refresh. The message names
        the arguments the user typed (``host_precision=``, ``wire_dtype=``).
        """
        if wire_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"wire_dtype must be torch.float32, torch.bfloat16 or torch.float16, got "
                f"wire_dtype={wire_dtype}"
            )
        if self.master_is_wire and wire_dtype != self.master_dtype:
            raise ValueError(
                f"{self.spelled} keeps {str(self.master_dtype).removeprefix('torch.')} master "
                f"weights, which are the wire copy, so it needs a bfloat16 wire dtype, got "
                f"wire_dtype={wire_dtype}. Leave wire_dtype out (the wire then follows the "
                "master) or pass wire_dtype=torch.bfloat16. Combinations that work: "
                "host_precision='fp32' with any wire_dtype; host_precision='bf16', 'lean' or "
                "'kahan' with a bfloat16 wire"
            )

    # ------------------------------------------------------------------ state tensors

    @property
    def state_names(self) -> tuple[str, ...]:
        """Names of AdamW's per-parameter state tensors in this format: the moments, their
        scales when block-wise, a Kahan compensation."""
        return self.state_format.state_names + self.master_format.state_names

    def new_state(self, name: str, n: int) -> torch.Tensor:
        """State ``name`` of ``n`` elements at zero, in this format (a flat host buffer)."""
        if name in self.master_format.state_names:
            return torch.zeros(n, dtype=self.master_dtype)
        return self.state_format.new(name, n)

    def state_view(self, name: str, flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """State ``name``'s part for elements ``lo:hi`` of its flat buffer (per element,
        or the blocks that cover them); ``lo`` is a multiple of ``STEP_ALIGN``."""
        return self.state_format.view(name, flat, lo, hi)

    # ------------------------------------------------------------------ the byte model

    def host_bytes(
        self,
        units: Iterable[StoredUnit],
        wire_dtype: torch.dtype,
        *,
        num_states: int = len(MOMENTS),
        full_gradients: bool = False,
        kept_grads: bool = False,
    ) -> HostBytes:
        """Host bytes of ``units`` under this policy with a wire of ``wire_dtype``, by part:
        the one byte model (the store's check, ``auto``, the plan, ``memory.estimate`` and
        the checkpoint's size read it). ``num_states``: fp32 state tensors per trained
        parameter in the exact formats (2 for AdamW, 1 for SGD with momentum); the lean
        formats' states are AdamW's. ``full_gradients``: the loop makes the full gradient
        buffer that a ring makes only for the steps that need one (clipping, accumulation,
        steps kept out of backward; see ``gradients``): counted as ``gradients`` beside
        the ring's staging. ``kept_grads``: the optimizer keeps ``p.grad``
        (``keep_grads=True``), so the deferred gradients are in the master's dtype, not in
        8-bit codes (``compact_deferred``)."""
        units = list(units)
        master = self.master_format
        wire_size = _size(wire_dtype)
        master_size = _size(master.dtype)
        trainable = sum(u.trainable_numel for u in units)
        largest = max((u.trainable_numel for u in units), default=0)
        ring = self.gradient_format.ring
        if self.compact_deferred and not kept_grads:
            deferred = sum(compact_nbytes(u.trainable_numel) for u in units)
        else:
            deferred = trainable * master_size
        return HostBytes(
            master=sum(u.kept_numel for u in units if u.given_master is None) * master_size,
            wire=sum(u.kept_numel for u in units) * master.wire_copy_bytes(wire_dtype),
            compressed=sum(
                compressed_nbytes(u.frozen_format, n, wire_dtype)
                for u in units
                for n in u.compressed_numels()
            ),
            gradients=(deferred if full_gradients else 0) if ring else trainable * master_size,
            staging=RING_BUFFERS * largest * wire_size if ring else trainable * wire_size,
            states=self.state_bytes(trainable, num_states=num_states),
            deferred_gradients=deferred if ring and not full_gradients else 0,
        )

    def state_bytes(self, numel: int, *, num_states: int = len(MOMENTS)) -> int:
        """Bytes of the optimizer's states (and a Kahan compensation) for ``numel`` trained
        parameter elements; ``num_states`` as for ``host_bytes``."""
        states = self.state_format.bytes_per_parameter(
            num_states if self.is_exact else len(MOMENTS)
        )
        return int(numel * (states + self.master_format.state_bytes_per_parameter))

    def bytes_per_parameter(self, *, trainable: bool, wire_dtype: torch.dtype) -> float:
        """Host RAM per parameter, in bytes, under this policy with a wire of ``wire_dtype``.

        Trained: master (fp32 4 plus the wire copy; bf16-sr 2, it is the wire copy;
        bf16-kahan 2) + states (fp32 8; bf16 4; fp8 2 + 2 x 4 / 256 for the scales; a Kahan
        master's compensation, 2, is counted here as the optimizer keeps it) + gradients
        (full: the master's dtype plus staging in the wire dtype; ring: 0). Frozen
        (``trainable=False``): stored once in the wire dtype, except with fp32 masters,
        which keep today's fp32 master and wire copy.

        Raises:
            ValueError: ``check_wire`` fails for ``wire_dtype``.
        """
        self.check_wire(wire_dtype)
        master = self.master_format
        per_master = _size(master.dtype) + master.wire_copy_bytes(wire_dtype)
        if not trainable:
            return float(per_master)
        gradients = self.gradient_format.bytes_per_parameter(master, wire_dtype)
        return per_master + self.optimizer_state_bytes_per_parameter + gradients

    @property
    def optimizer_state_bytes_per_parameter(self) -> float:
        """AdamW's states per trained parameter, in bytes (fp32 8; bf16 4; fp8 2 plus two
        fp32 scales per block), plus a Kahan master's bf16 compensation (2), which the
        optimizer keeps with its states."""
        return (
            self.state_format.bytes_per_parameter() + self.master_format.state_bytes_per_parameter
        )

    @property
    def device_step_bytes_per_parameter(self) -> float:
        """Device bytes per trainable parameter of a unit stepped on the device
        (``ramflow.offload(device_optimizer=True)``): fp32 masters keep an fp32 master and
        fp32 states there (12); a bf16 master is the unit's device copy, so only the states
        (8-bit: 2 plus the scales; bf16: 4) and a Kahan compensation (2) are added; an fp32
        master with lean states adds its fp32 copy (4)."""
        if self.is_exact:
            return float(DEVICE_STEP_BYTES_PER_PARAM)
        return (
            self.optimizer_state_bytes_per_parameter
            + self.master_format.device_step_bytes_per_parameter
        )

    @property
    def device_step_scratch_bytes(self) -> int:
        """Device scratch of one piece of a device step (``planner.plan``'s constants)."""
        return DEVICE_STEP_SCRATCH_BYTES if self.is_exact else LEAN_DEVICE_STEP_SCRATCH_BYTES

    @property
    def compact_deferred(self) -> bool:
        """Whether a step not applied during backward may hold its gradients in 8-bit
        codes (``formats.deferred_grad``): under the gradient ring with masters that are not
        exact (bf16-sr, bf16-kahan); fp32 masters keep them in fp32."""
        return self.gradient_format.ring and not self.master_format.exact

    @property
    def is_exact(self) -> bool:
        """Whether steps are bit-identical to torch's fused AdamW (fp32 masters and states)."""
        return self.master_format.exact and self.state_format.exact


def moments_into(
    precision: HostPrecision, state: dict, views: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """AdamW's moments of one parameter (``state``'s ``exp_avg``/``exp_avg_sq``, any dtype
    and device) written into ``views``, its flat host state in ``precision``'s format
    (``StateFormat.encode``); a Kahan compensation is left at zero. Returns ``views``."""
    for name in MOMENTS:
        value = state[name].detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        precision.state_format.encode(name, value, views)
    return views


def holds_moments(state: dict) -> bool:
    """Whether one parameter's optimizer ``state`` holds AdamW's first moment, in any
    state format (or the 8-bit format before the FP8 code)."""
    return any(
        name in state for f in OPTIMIZER_STATES.values() for name in f.moment_names(MOMENTS[0])
    )


def moments_to_plain(state: dict, p: torch.Tensor, *, plain: bool) -> None:
    """``state``'s moments, as a unit's host format keeps them (whichever format holds
    exactly these state tensors), made plain tensors in place: block-wise ones decoded, a
    compensation dropped; in ``p``'s dtype and device when ``plain`` (a plain optimizer's),
    else fp32 on the host (for another unit). Moments in the 8-bit format before the FP8
    code (``formats.legacy_states``) are decoded too."""
    legacy = pop_legacy_moments(state)
    fmt = next(
        (f for f in OPTIMIZER_STATES.values() if f.block and set(f.state_names) <= state.keys()),
        OPTIMIZER_STATES["fp32"],
    )
    for name in MOMENTS:
        if name not in legacy and not set(fmt.moment_names(name)) <= state.keys():
            continue
        value = legacy[name] if name in legacy else fmt.decode(name, state)
        # a 4-bit moment of a parameter of odd size decodes one element more
        value = value.detach().to(torch.float32).reshape(-1)[: p.numel()].view(p.shape)
        state[name] = value.to(p.device, p.dtype, copy=True) if plain else value.clone()
    for master in MASTERS.values():
        for name in master.state_names:
            state.pop(name, None)


def upgrade_legacy_state(precision: HostPrecision, state: dict) -> dict:
    """One parameter's saved optimizer ``state`` with moments in the 8-bit format before the
    FP8 code (``exp_avg_absmax``... , see ``formats.legacy_states``) converted to ``precision``'s
    format: decoded to fp32 and stored as ``moments_into`` stores moments. Other entries
    (the step, a Kahan compensation) are kept. Returns ``state`` itself when it holds no
    old-format moments, else a new dict (``state`` is not changed).

    Raises:
        ValueError: an old absmax without its uint8 codes.
    """
    if not has_legacy_moments(state):
        return state
    out = dict(state)
    decoded = pop_legacy_moments(out)
    fmt = precision.state_format
    for name, value in decoded.items():
        views = {k: fmt.new(k, value.numel()) for k in fmt.moment_names(name)}
        fmt.encode(name, value, views)
        if name in views:  # per element: the parameter's shape
            views[name] = views[name].view(out[name].shape)
        else:  # a format whose moments have names of their own (4-bit)
            del out[name]
        out.update(views)
    return out


FP32 = HostPrecision.fp32()
"""The policy of a unit that has none (not built by a store yet): fp32 throughout."""


def saved_state_shape(name: str, param_shape: torch.Size) -> tuple[int, ...]:
    """The shape a checkpoint holds for optimizer state ``name`` of a parameter of
    ``param_shape``, in whichever format owns that state: the parameter's, or its blocks'
    (1-D) for a block-wise scale, or an absmax of the 8-bit format before the FP8 code."""
    n = math.prod(param_shape)
    if is_legacy_name(name):
        return (-(-n // LEGACY_BLOCK),)
    for f in OPTIMIZER_STATES.values():
        if name in f.state_names and f.numel(name, n) != n:
            return (f.numel(name, n),)
    return tuple(param_shape)


def check_optimizer_formats(precision: HostPrecision, optimizer: Any) -> None:
    """Raise ValueError when ``optimizer`` has no CPU step for ``precision``'s formats.

    Args:
        precision: the policy.
        optimizer: a name (``"AdamW"``, ``"SGD"``, case ignored), an optimizer class or an
            optimizer instance (named by its class).

    Raises:
        ValueError: lean masters or states (anything but fp32) with an optimizer other than
            AdamW or Lion; the message names the combinations that work.
    """
    if isinstance(optimizer, str):
        name = optimizer
    elif isinstance(optimizer, type):
        name = optimizer.__name__
    else:
        name = type(optimizer).__name__
    if precision.is_exact or name.lower() in _LEAN_OPTIMIZERS:
        if name.lower() == "adamw" or precision.state_format.step_chunk is None:
            return
        # Lion's step reads its one moment as the 8-bit and bf16 formats hold it
        raise ValueError(
            f"{name} has no CPU step for optimizer_states={precision.optimizer_states!r} "
            f"({precision.spelled}): those states are AdamW's. Use ramflow.optim.AdamW, or "
            "host_precision='lean' with Lion"
        )
    raise ValueError(
        f"{name} has no CPU step for {precision.spelled} (master={precision.master!r}, "
        f"optimizer_states={precision.optimizer_states!r}). Combinations that work: any "
        "optimizer with host_precision='fp32' (HostPrecision.fp32()); ramflow.optim.AdamW "
        "or ramflow.optim.Lion with any host_precision (e.g. host_precision='lean')"
    )
