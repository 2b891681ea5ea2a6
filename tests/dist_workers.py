"""Code that runs inside the processes of the distributed tests (one per rank).

Each worker takes (rank, world_size, options) and writes what it measured to
``options["out"]/rank{rank}.pt``; an exception is written there too, as text, so that the
test can assert on it. Processes are real (forked from a server that has imported torch
and ramflow once), the process group is gloo on the CPU (CI) or NCCL on GPUs (the GPU box).

[Note: ranks fork from a preloaded server]
A spawned rank imports torch, ramflow and transformers before it runs a line of the test:
about 4 CPU-seconds, most of a small distributed test's cost. The ranks are started
through multiprocessing's ``forkserver`` instead, whose server imports this module (and
with it torch and ramflow) once per test process (``tests/conftest.py`` sets its preload
list); each rank is a fork of it, a fresh process with no CUDA context, threads or process
group of the test's. The server's environment is the one of the moment it started, so
each rank takes the test's environment at ``run`` (a ``monkeypatch.setenv`` before ``run``
reaches the ranks, as it did with ``spawn``).
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import ramflow
from models import MLPStack
from ramflow.distributed.zero import STORE_FILE
from ramflow.units.registry import engine_of_model

STEPS = 4
GLOBAL_BATCH = 8
DIM = 16  # MLPStack input width


def batches(steps: int = STEPS, batch: int = GLOBAL_BATCH, dim: int = DIM):
    """The global batches every test uses: inputs (batch, dim) and targets (batch, 8)."""
    g = torch.Generator().manual_seed(123)
    return [
        (torch.randn(batch, dim, generator=g), torch.randn(batch, 8, generator=g))
        for _ in range(steps)
    ]


def reference_model(seed: int = 0, dim: int = 32) -> MLPStack:
    torch.manual_seed(seed)
    return MLPStack(dim=dim, depth=4, out=8)


def run(fn, world_size: int, options: dict, *, timeout: float = 120.0) -> list[dict]:
    """Start ``world_size`` processes running ``fn(rank, world_size, options)`` and return
    each rank's result (a dict; ``{"error": text}`` for a rank that raised, ``{"exitcode":
    n}`` for one that died). Ranks still running after ``timeout`` seconds are killed and
    reported as ``{"timeout": True}``."""
    ctx = mp.get_context("forkserver")  # See [Note: ranks fork from a preloaded server]
    out = options["out"]
    os.makedirs(out, exist_ok=True)
    options = {
        **options,
        "init": f"file://{os.path.join(out, 'rendezvous')}",
        "environ": dict(os.environ),
    }
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, options)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    results = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            results.append({"timeout": True})
            continue
        path = os.path.join(out, f"rank{r}.pt")
        if os.path.exists(path):
            results.append(torch.load(path, weights_only=False))
        else:
            results.append({"exitcode": p.exitcode})
    return results


def _entry(fn, rank: int, world_size: int, options: dict) -> None:
    # the test's environment now, not the server's from when it started
    os.environ.clear()
    os.environ.update(options["environ"])
    torch.set_num_threads(1)
    if "shm_dir" in options:  # where the shared host store puts its files
        os.environ["RAMFLOW_SHM_DIR"] = options["shm_dir"]
    if "hosts" in options:  # simulated hosts: this rank's host name
        os.environ["RAMFLOW_TEST_HOST"] = options["hosts"][rank]
    backend = options.get("backend", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=options["init"],
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=options.get("pg_timeout", 60)),
    )
    try:
        result = fn(rank, world_size, options)
    except BaseException as err:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    torch.save(result, os.path.join(options["out"], f"rank{rank}.pt"))
    if "error" not in result:
        dist.destroy_process_group()
    elif backend == "nccl":
        # an NCCL communicator whose peer died may wait for it at teardown: leave at once
        os._exit(0)


def _device(rank: int, options: dict) -> torch.device:
    return torch.device("cuda", rank) if options.get("backend") == "nccl" else torch.device("cpu")


def _store_bytes() -> dict[str, int]:
    """Resident bytes of this process's mappings of the shared host store's files (named
    as ``ramflow.distributed.zero.STORE_FILE``): rss, pss (rss divided among the processes sharing
    each page) and private."""
    rss = pss = private = 0
    files = []
    for m in psutil.Process().memory_maps(grouped=True):
        name = os.path.basename(m.path).removesuffix(" (deleted)")
        if STORE_FILE.fullmatch(name):
            rss += m.rss
            pss += m.pss
            private += m.private_clean + m.private_dirty
            files.append(name)
    return {"rss": rss, "pss": pss, "private": private, "files": sorted(files)}


def train_offload(rank: int, world_size: int, options: dict) -> dict:
    """``ramflow.offload(model, zero_stage=...)`` on this rank's slice of each global batch.
    Ranks other than 0 build their model from another seed: the shared host copy must
    give them rank 0's weights. ``zero_stage`` None: each process offloads on its own
    (private host copies, no gradient reduction; the memory baseline). Options beside:
    ``host_precision`` and ``wire_dtype`` (default fp32) go to ``offload``; ``whole_batch``:
    every rank trains on the whole global batch (its averaged gradients are then one
    process's, bit for bit, on two ranks); ``muon``: ``ramflow.optim.Muon`` (its defaults,
    lr 1e-2) instead of AdamW; ``optimizer``: (a ``ramflow.optim`` class name, its settings)
    instead of AdamW; ``gpu_memory``, ``device_optimizer``: ``offload``'s (a budget keeps
    units resident, on the CPU too); ``state_each_step``: keep ``model.state_dict()`` taken
    right after each ``opt.step()``; ``undo``: ``ramflow.undo`` right after the last step and
    return only the plain model's state and those; ``norm_piece``: the elements per piece
    of a CPU norm (``ramflow.engine.clip.NORM_PIECE``), small so that this model's gradients are
    reduced in several."""
    if options.get("norm_piece"):
        from ramflow.engine import clip as _clip

        _clip.NORM_PIECE = options["norm_piece"]
    device = _device(rank, options)
    model = reference_model(seed=rank, dim=options.get("dim", 32))
    ramflow.offload(
        model,
        device=device,
        zero_stage=options["zero_stage"],
        wire_dtype=options.get("wire_dtype", torch.float32),
        host_precision=options.get("host_precision"),
        gpu_memory=options.get("gpu_memory"),
        device_optimizer=options.get("device_optimizer"),
    )
    if options.get("muon"):
        opt = ramflow.optim.Muon(model.parameters(), lr=1e-2)
    elif options.get("optimizer"):  # (a ramflow.optim class name, its settings)
        name, settings = options["optimizer"]
        opt = getattr(ramflow.optim, name)(model.parameters(), **settings)
    else:
        opt = ramflow.optim.AdamW(
            model.parameters(), lr=1e-2, keep_grads=options.get("keep_grads", True)
        )
    if options.get("slow_owner") is not None and rank == options["slow_owner"]:
        _slow_host_steps(opt, seconds=0.2)
    per_rank = GLOBAL_BATCH // world_size
    losses, norms, grads_left, step_states = [], [], [], []
    kill = options.get("kill")  # ("backward" or "step", step): SIGKILL rank 1 there
    if kill is not None and kill[0] == "backward" and rank == 1:
        _kill_in_backward_at(model, step=kill[1])
    for step, (x, y) in enumerate(batches()):
        if options.get("die_after") is not None and rank == 1 and step == options["die_after"]:
            os._exit(3)
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        if options.get("whole_batch"):
            sl = slice(None)
        # the loss in fp32: with a bf16 wire the model computes in bf16, and torch 2.11's
        # mse_loss backward rejects a bf16 input with an fp32 target
        loss = F.mse_loss(model(x[sl].to(device)).float(), y[sl].to(device))
        loss.backward()
        grads_left.append(sum(p.grad is not None for p in model.parameters()))
        if options.get("clip"):
            norms.append(ramflow.clip_grad_norm_(model.parameters(), options["clip"]).item())
        opt.step()
        if options.get("state_each_step"):  # at once: this step may still run on the worker
            step_states.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        if kill == ("step", step) and rank == 1:
            # opt.step() has returned; this rank's steps and the barrier run on its worker
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        losses.append(loss.detach().clone())
    if options.get("undo"):  # right after the last step, which may still run on the worker
        ramflow.undo(model)
        plain = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        return {"state": plain, "step_states": step_states}
    # summed over the ranks only now: a rank that dies mid-run fails the others in
    # ramflow's collectives, not in this one
    total = torch.stack(losses)
    dist.all_reduce(total)
    losses = [t / world_size for t in total.tolist()]
    ramflow.synchronize(model)
    memory = _store_bytes()  # after every rank has read every page
    memory["uss"] = psutil.Process().memory_full_info().uss
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    plan = ramflow.get_plan(model)
    engine = engine_of_model(model)
    resident = [u for u in engine.units if u.resident and u.num_trainable]
    return {
        # every resident unit's device copy holds its wire copy's bytes after the last step
        # (however it got there: a copy from the host, or the owner's broadcast)
        "device_current": bool(resident)
        and all(
            torch.equal(
                u.device_alias[: u.trainable_numel].cpu(), u.wire[: u.trainable_numel].cpu()
            )
            for u in resident
        ),
        "broadcast_units": len(engine.stepper.dist.broadcast_units) if engine.stepper.dist else 0,
        "losses": losses,
        "norms": norms,
        "grads_left": grads_left,
        "state": state if rank == 0 else None,
        "memory": memory,
        "host_precision": (plan.host_precision.name, plan.host_precision_reason),
        "device_optimizer": (plan.device_stepped, plan.device_optimizer_reason),
        "unit_names": [u.name for u in engine.units if u.num_trainable],
        # parameters the CPU optimizer stepped over the run (flat steps count padding)
        "host_steps": engine.host_stepper.host_step_totals()[0],
        # the optimizer states this rank holds: (parameters with states, their dtypes)
        "states": (
            sum(bool(st) for st in opt.state.values()),
            sorted({str(t.dtype) for st in opt.state.values() for t in st.values()}),
        ),
    }


def _slow_host_steps(opt: torch.optim.Optimizer, *, seconds: float) -> None:
    """Make this rank's host steps start ``seconds`` late: the other ranks then reach the
    next forward long before the units this rank owns are written, so a rank that read a
    unit before its owner published it would train on the previous step's weights."""
    flat_step = opt.flat_step

    def late(*args, **kwargs):
        time.sleep(seconds)
        return flat_step(*args, **kwargs)

    opt.flat_step = late


def _kill_in_backward_at(model: torch.nn.Module, *, step: int) -> None:
    """SIGKILL this process in the backward pass of forward call ``step`` (counted from 0),
    when the gradient of the second block's output is computed: the later units' gradients
    have been reduced, the earlier ones' have not."""
    calls = iter(range(1 << 30))

    def on_forward(module, args, out):
        if next(calls) == step:
            out.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))

    model.blocks[1].register_forward_hook(on_forward)


def offload_failing_in_set_up(rank: int, world_size: int, options: dict) -> dict:
    """``ramflow.offload(model, zero_stage=2)`` whose set-up fails right after the leader
    has created its shared-memory files, at the barrier that follows: the barrier raises
    (``options["fail"] == "raise"``) or the process dies on the spot (``"exit"``, as under
    SIGKILL: no Python code runs)."""

    def failing_barrier(*args, **kwargs):
        if options["fail"] == "exit":
            os._exit(3)
        raise RuntimeError("the set-up barrier failed (injected by the test)")

    dist.barrier = failing_barrier
    model = reference_model(seed=rank)
    ramflow.offload(model, device=torch.device("cpu"), zero_stage=2, wire_dtype=torch.bfloat16)
    return {}


def offload_mismatched(rank: int, world_size: int, options: dict) -> dict:
    """``ramflow.offload`` with what the ranks must agree on differing on rank 1:
    ``options["what"]`` is ``"zero_stage"`` (1 against 2; their collectives would not
    match, a hang) or ``"shapes"`` (the same unit sizes, other parameter shapes)."""
    torch.manual_seed(0)
    if options["what"] == "shapes" and rank == 1:
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(4, 8, bias=False)
        )
    else:
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 4, bias=False)
        )
    stage = 2 if options["what"] == "zero_stage" and rank == 1 else 1
    ramflow.offload(model, device=torch.device("cpu"), zero_stage=stage)
    return {}


def _private_bytes() -> int:
    """This process's anonymous resident memory (``RssAnon``: not its file or shared
    mappings, so not the shared host store it maps)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


class PeakSampler:
    """The peak of ``_private_bytes`` while it runs, sampled every millisecond by a thread."""

    def __init__(self) -> None:
        import threading

        self.peak = _private_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _private_bytes())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _private_bytes())


def meta_model(options: dict) -> torch.nn.Module:
    """The model of ``load_meta`` on the meta device: an MLPStack (``options["dim"]``,
    ``["depth"]``), or the ``transformers`` model of ``options["folder"]``'s config."""
    if "folder" in options:
        from ramflow.train.modeling import meta_model as hf_meta_model
        from ramflow.train.modeling import read_config

        return hf_meta_model(read_config(options["folder"]))
    with torch.device("meta"):
        return MLPStack(dim=options.get("dim", 32), depth=options.get("depth", 4), out=8)


def load_meta(rank: int, world_size: int, options: dict) -> dict:
    """Every rank builds its model on the meta device and offloads it with ``weights=``
    and ``zero_stage=2``: the folder ``options["folder"]``, or ``SeededInit(seed=0)``
    wrapped to record the names this rank draws. ``fail_on``: that rank's weights
    function raises at its first parameter; ``missing_on``: that rank is given a folder
    that does not exist. Returns the weights (rank 0's, or every rank's with
    ``all_states``), the names drawn, whether the model is back on meta after an error,
    and the peak of this rank's private memory over its baseline while loading."""
    from ramflow.train.initialization import SeededInit

    model = meta_model(options)
    drawn: list[str] = []
    if "folder" in options:
        weights = options["folder"]
        if options.get("missing_on") == rank:
            weights = os.path.join(options["folder"], "not-there")
    else:
        init = SeededInit(model, seed=0, num_threads=1)

        def weights(name: str, out: torch.Tensor) -> None:
            if options.get("fail_on") == rank:
                raise OSError(f"cannot draw {name} (injected by the test)")
            drawn.append(name)
            init(name, out)

    baseline = _private_bytes()
    try:
        with PeakSampler() as sampler:
            ramflow.offload(
                model,
                device=_device(rank, options),
                zero_stage=2,
                wire_dtype=options.get("wire_dtype", torch.float32),
                host_precision=options.get("host_precision"),
                weights=weights,
            )
    except Exception as err:  # noqa: BLE001 - reported with what became of the model
        return {
            "error": f"{type(err).__name__}: {err}",
            "on_meta": all(p.is_meta for p in model.parameters()),
        }
    units = model._ramflow_engine.units
    # every rank reads every page of the masters and wire copies, then the pages are all
    # shared. A page the kernel moves afterwards (khugepaged collapsing tmpfs pages under
    # load, say) is mapped again only where it is next touched, and reads as private to one
    # process until then. A CI run under load (2026-11-28) once saw private bytes here,
    # cause not pinned down: so read again and look again, at most twice, all ranks
    # together. A rank's own copy of a page would stay private however often it is read.
    for reads in range(1, 4):
        for u in units:
            u.master.sum()
            u.wire.sum()
        dist.barrier()
        memory = {**_store_bytes(), "reads": reads}
        any_private = torch.tensor([float(memory["private"] > 0)], device=_device(rank, options))
        dist.all_reduce(any_private)
        if any_private.item() == 0:
            break
    memory["private_peak"] = sampler.peak - baseline
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    x = batches()[0][0]
    out = model(x).detach().cpu() if "folder" not in options else None
    return {
        "state": state if rank == 0 or options.get("all_states") else None,
        "drawn": drawn,
        "owned": [p for u in units if u.owner == rank for p in _names_of(model, u)],
        "memory": memory,
        "out": out,
    }


def first_step_private(rank: int, world_size: int, options: dict) -> dict:
    """The Llama shape of ``train_meta_private``, offloaded and trained the same way for
    ``options["steps"]`` steps. Returns what the optimizer holds before its first step
    (the units whose flat states exist, the parameters with a state, the gradient ring's
    buffers), the bytes of this rank's states and ring, and each step's rise of this
    rank's private memory (``RssAnon`` after the step, its optimizer steps done, minus
    before it). ``lazy``: states and ring made inside the first step, as before they were
    made at set-up (the test's control)."""
    from ramflow.engine.engine import Engine
    from ramflow.optim.host_optimizer import HostOptimizer

    if options.get("lazy"):
        HostOptimizer._make_unit_states = lambda self, engine: None
        Engine.prepare_first_step = lambda self: None
    model, opt = _llama_lean(rank, options)
    engine = engine_of_model(model)
    owned = [u for u in engine.units if u.owner == rank and u.num_trainable]
    before = {
        "units_with_states": sorted(u.index for u in opt.unit_states),
        "params_with_state": sum(1 for p in model.parameters() if opt.state.get(p)),
        "ring": engine.host._ring_made,
    }
    precision = engine.host.precision
    g = torch.Generator().manual_seed(rank)
    rises = []
    for _ in range(options["steps"]):
        level = _private_bytes()
        ids = torch.randint(0, 256, (1, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        ramflow.synchronize(model)
        rises.append(_private_bytes() - level)
    return {
        "before": before,
        "owned": sorted(u.index for u in owned),
        "states_bytes": precision.state_bytes(sum(u.trainable_numel for u in owned)),
        "ring_bytes": precision.host_bytes(engine.units, engine.wire_dtype).staging,
        # on the CPU the device's buffers (window, resident units, gradients) are host
        # memory too, made in the first step as on a GPU
        "device_side": engine.plan.planned_bytes,
        "rises": rises,
    }


def _llama_meta(options: dict) -> torch.nn.Module:
    """``train_meta_private``'s Llama shape (``options["hidden"]`` wide, ``["layers"]``
    deep) on the meta device, with glibc returning buffers of 1 MiB and more when freed."""
    import ctypes

    from transformers import LlamaConfig

    from ramflow.train.modeling import meta_model as hf_meta_model

    # Buffers of 1 MiB and more get pages of their own, given back when freed, as a GPU
    # run's are (its units are GBs, above glibc's largest dynamic mmap threshold, 32 MiB).
    # Without this, glibc raises the threshold past this small model's units after the
    # first free, and keeps their freed buffers in its heap: RSS the GPU run does not have.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    config = LlamaConfig(
        vocab_size=256, hidden_size=options["hidden"], intermediate_size=3 * options["hidden"],
        num_hidden_layers=options["layers"], num_attention_heads=8, num_key_value_heads=8,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return hf_meta_model(config)


def _llama_lean(
    rank: int, options: dict, model: torch.nn.Module | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``model`` (default ``_llama_meta(options)``) offloaded as ``train_meta_private``
    offloads it (``zero_stage=2``, lean host formats, the seeded init) and its optimizer
    (AdamW over the recipe's two param groups, ``keep_grads=False``)."""
    from ramflow.train.initialization import SeededInit

    if model is None:
        model = _llama_meta(options)
    ramflow.offload(
        model,
        device=_device(rank, options),
        zero_stage=2,
        host_precision="lean",
        weights=SeededInit(model, seed=0, num_threads=1),
    )
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return model, ramflow.optim.AdamW(groups, lr=1e-3, overlap=True, keep_grads=False)


def train_meta_private(rank: int, world_size: int, options: dict) -> dict:
    """A Llama shape built on the meta device, offloaded as ``ramflow train`` offloads it on
    several ranks (``zero_stage=2``, lean host formats, ``weights=SeededInit``) and trained
    as it trains it without clipping: AdamW over the recipe's two param groups (matrices
    with weight decay, vectors without; every layer holds both), ``keep_grads=False``, so
    units step during backward. Returns the peak of this rank's private memory
    (``RssAnon``) while it offloads, builds the optimizer and trains (``growth``: over its
    level before ``offload``), the part of the plan's bytes that is this rank's own
    (``plan``: its units' optimizer states, its gradient ring, and, on the CPU, its
    "device" side; ``plan_parts`` by name) and the host gradient buffers its units hold at
    the end."""
    model = _llama_meta(options)
    g = torch.Generator().manual_seed(rank)
    baseline = _private_bytes()
    with PeakSampler() as sampler:
        model, opt = _llama_lean(rank, options, model)
        for _ in range(options.get("steps", 3)):
            ids = torch.randint(0, 256, (1, 16), generator=g).to(_device(rank, options))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        ramflow.synchronize(model)
    engine = engine_of_model(model)
    owned = [u for u in engine.units if u.owner == rank]
    precision = engine.host.precision
    parts = {
        "states": precision.state_bytes(sum(u.trainable_numel for u in owned)),
        "ring": precision.host_bytes(engine.units, engine.wire_dtype).staging,
        "device_side": engine.plan.planned_bytes if engine.device.type == "cpu" else 0,
    }
    return {
        "growth": sampler.peak - baseline,
        "plan": sum(parts.values()),
        "plan_parts": parts,
        "host_grads": sum(u.host_grad.nbytes for u in engine.units if u.host_grad is not None),
        "owned_bytes": sum(u.trainable_numel for u in owned) * 2,
    }


def _names_of(model: torch.nn.Module, unit) -> list[str]:
    """The first names of a unit's parameters."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return [names[id(p)] for p in unit.owned]


def moe_reference(num_experts: int = 4, dim: int = 8, top_k: int = 2, tokens: int = 6):
    """The tiny MoE layer both sides of the expert-parallel test use: a router and
    ``num_experts`` linear experts, the same on every rank and in the single process."""
    torch.manual_seed(123)
    router = torch.nn.Linear(dim, num_experts, bias=False)
    experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(num_experts))
    return router, experts, top_k, tokens, dim


def moe_tokens(rank: int, tokens: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(tokens, dim, generator=g)


def moe_forward(x, router, experts_apply, top_k):
    """Router then experts: ``experts_apply(x, expert_TK)`` -> (T, K, D) outputs."""
    probs = torch.softmax(router(x), dim=-1)
    weight, expert = torch.topk(probs, top_k, dim=-1)
    return weight, expert


def expert_parallel(rank: int, world_size: int, options: dict) -> dict:
    """One MoE layer with its experts split over the ranks: forward, then backward of a
    fixed weighting of the outputs. Returns this rank's outputs and gradients."""
    from ramflow.distributed.experts import ExpertPlacement, combine, dispatch

    router, experts, top_k, tokens, dim = moe_reference(**options.get("moe", {}))
    placement = ExpertPlacement(len(experts), world_size)
    x = moe_tokens(rank, tokens, dim).requires_grad_(True)
    weight, expert = moe_forward(x, router, None, top_k)
    batch = dispatch(x, expert, placement)
    mine = list(placement.experts_of(rank))
    y = torch.zeros(batch.rows_ND.shape[0], dim)
    for local, e in enumerate(mine):
        sel = (batch.local_expert_N == local).nonzero().squeeze(1)
        y = y.index_copy(0, sel, experts[e](batch.rows_ND[sel]))
    out = combine(y, batch, weight)
    g = torch.Generator().manual_seed(2000 + rank)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "router_grad": router.weight.grad,
        "expert_grads": {e: experts[e].weight.grad for e in mine},
        "recv_counts": batch.recv_counts,
    }
