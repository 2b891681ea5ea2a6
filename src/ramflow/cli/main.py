"""The ``ramflow`` command: ``train``, ``generate``, ``plan`` and ``profile``.

Thin by design: it parses options and calls ``ramflow.train``; the logic lives there.
Exit status: 0 done, 1 the plan does not fit this machine, 2 a usage or input error
(the message says what to change; also a run refused by its disk, RAM or a run folder in
use, a full disk during a save, and a training loss that became NaN or infinite), 130 stopped by Ctrl-C and 143 by SIGTERM (after saving
a checkpoint).
"""

from __future__ import annotations

import argparse
import difflib
import re
import signal
import sys
from collections.abc import MutableMapping, Sequence
from typing import Any, NoReturn

# The parser reads only modules without PyTorch (``choices``, ``train.presets``), so that
# --help and a usage error answer at once; each command imports what it runs.
from ..choices import (
    CHECKPOINTING_MODES,
    COMPUTE_PRECISIONS,
    DEVICE_OPTIMIZER,
    FROZEN_FORMATS,
    HOST_PRECISIONS,
    NUMA_BINDINGS,
    TRACKERS,
)
from ..train.presets import PRESETS

_TRAIN_OPTIONS = (
    "preset",
    "model",
    "tokenizer",
    "data",
    "steps",
    "batch_size",
    "seq_len",
    "grad_accum",
    "global_batch",
    "lr",
    "optimizer",
    "min_lr_ratio",
    "warmup_steps",
    "decay_steps",
    "weight_decay",
    "clip_grad",
    "precision",
    "checkpointing",
    "host_precision",
    "device_optimizer",
    "seed",
    "device",
    "gpu_memory",
    "save_every",
    "keep_checkpoints",
    "eval_every",
    "eval_batches",
    "val_fraction",
    "lora_rank",
    "lora_targets",
    "frozen_format",
    "fuse_lora",
)

_EXIT_STATUS = (
    "exit status: 0 done; 1 `ramflow plan`: the run does not fit this machine; 2 a usage or "
    "input error (one line on stderr says what to change; nothing is written); 130 / 143 "
    "stopped by Ctrl-C / SIGTERM, after saving a checkpoint"
)


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=None,
        help="model shape to build (default: tiny): "
        + "; ".join(f"{k}: {v.description}" for k, v in PRESETS.items()),
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="a local Hugging Face causal LM folder (config.json + safetensors; any architecture "
        "transformers knows), or a Hub id org/name from the local Hugging Face cache, instead "
        "of a preset",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="a local Hugging Face tokenizer folder (default: the model folder's, else byte-level)",
    )
    p.add_argument(
        "--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)"
    )
    p.add_argument(
        "--precision",
        choices=COMPUTE_PRECISIONS,
        default=None,
        help="compute precision (default auto: bf16 on CUDA, fp32 on the CPU); fp16 uses a GradScaler",
    )
    p.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        default=None,
        help="device budget for the whole run, e.g. 12GiB (default: 90%% of free GPU memory)",
    )


def _frozen_format_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--frozen-format",
        choices=FROZEN_FORMATS,
        default=None,
        help=f"keep {what} compressed in host RAM (int8: block-wise absmax, nf4: QLoRA's "
        "4-bit, mxfp4: OCP MX 4-bit floats, gpt-oss's experts kept as they ship) and "
        "dequantize them on the device (default: the wire dtype)",
    )


def _lora_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora",
        dest="lora_rank",
        type=int,
        default=None,
        metavar="RANK",
        help="train LoRA adapters of this rank (PEFT) on the frozen base, kept on the device; "
        "checkpoints hold the adapters in PEFT's format (PeftModel.from_pretrained loads them)",
    )
    p.add_argument(
        "--lora-targets",
        default=None,
        metavar="NAMES",
        help="comma-separated linear modules (q_proj) or stacked expert parameters "
        "(experts.gate_up_proj) that get adapters (default: those of q_proj,k_proj,v_proj,"
        "o_proj,gate_proj,up_proj,down_proj the model has, and a mixture of experts' "
        "stacked experts)",
    )


def _batch_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a number of sequences or 'auto'"
        ) from None


def _shape_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch-size",
        type=_batch_size,
        default=None,
        metavar="{N,auto}",
        help="sequences per micro-batch (default: the preset's); auto: the largest that fits "
        "the device budget, with the accumulation that reaches --global-batch",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        metavar="N",
        help="sequences per optimizer step (default: --batch-size x --grad-accum); an "
        "out-of-memory error halves the micro-batch and doubles the accumulation, keeping it",
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)"
    )
    p.add_argument(
        "--checkpointing",
        choices=CHECKPOINTING_MODES,
        default=None,
        help="activation checkpointing; offload: on, with the layers' inputs in pinned host "
        "memory (default auto: on when activations would not fit the budget, offload when "
        "even that does not; an out-of-memory error at a micro-batch of 1 takes the next "
        "heavier one)",
    )
    p.add_argument(
        "--host-precision",
        choices=HOST_PRECISIONS,
        default=None,
        help="how master weights, AdamW states and host gradients are kept in RAM: fp32 "
        "(default; exact, about 20 bytes per parameter), bf16 (bf16 masters with stochastic "
        "rounding and bf16 states: 6), lean (bf16 masters, 8-bit states: 4), kahan (bf16 "
        "masters with compensation, 8-bit states: 6), lean4 (bf16 masters, 4-bit AdamW "
        "states, Li et al. 2023: 3.06; AdamW only, a slower CPU step), auto (fp32 where it "
        "fits this "
        "machine's RAM with room to spare, else lean)",
    )


def _run_length_options(p: argparse.ArgumentParser, *, resume: bool) -> None:
    """The run's steps and checkpoint cadence: ``train``'s, and ``plan``'s for the disk
    check, which counts the checkpoints on disk at once as ``train`` does. ``resume``:
    the parser has ``--resume``, whose meaning of ``--steps`` the help then gives."""
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps (default: the preset's; tiny: 150)"
        + (
            "; with --resume, the step to stop at: the LR schedule stays the first run's "
            "(at its floor past --decay-steps)"
            if resume
            else ""
        ),
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=None,
        help="checkpoint every N steps, 0: only at the end (default 500)",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=int,
        default=None,
        help="checkpoints kept on disk (default 1); 0 writes none (a benchmark or smoke run: "
        "Ctrl-C then loses the run)",
    )


class _OneLineErrors(argparse.ArgumentParser):
    """argparse with usage errors on one line (no usage block), and the closest choice
    suggested for a misspelt one: ``--host-precision lena`` -> did you mean 'lean'?"""

    def error(self, message: str) -> NoReturn:
        hint = ""
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(2))
            close = difflib.get_close_matches(m.group(1), choices, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
        self.exit(2, f"{self.prog}: error: {message}{hint} (--help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _OneLineErrors(
        prog="ramflow",
        description="Train and run models whose weights live in CPU RAM.",
        epilog=_EXIT_STATUS,
    )
    parser.add_argument("--version", action="version", version=f"ramflow {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{train,generate,plan,profile}"
    )

    t = sub.add_parser(
        "train",
        help="train a causal language model (default: tiny preset on the stdlib sources)",
        description="Train a causal language model with ramflow. With no options: the tiny "
        "preset on the Python standard library's sources, on the CPU when there is no GPU. "
        "It starts with whether the run fits and why, the budget and the plan.",
        epilog="exit status: 0 done; 2 a usage or input error, a run that does not fit this "
        "machine, or a run folder in use by another run (one line on stderr says what to "
        "change; nothing is written), or a run that stopped on a full disk or a training "
        "loss that became NaN or infinite (its last checkpoint is kept); 130 / 143 "
        "stopped by Ctrl-C / SIGTERM, after saving a checkpoint",
    )
    _model_options(t)
    _shape_options(t)
    t.add_argument(
        "--data",
        metavar="PATH",
        default=None,
        help="text file, folder of text files, or JSON lines with a 'text' field (default: the stdlib sources)",
    )
    _run_length_options(t, resume=True)
    t.add_argument(
        "--grad-accum", type=int, default=None, help="micro-batches per optimizer step (default 1)"
    )
    t.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default: the preset's AdamW LR, x1/3 for Lion, x5 for "
        "Adafactor, x10 for SGD)",
    )
    t.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="linear warmup steps (default: steps/5, at most 200)",
    )
    t.add_argument(
        "--decay-steps",
        type=int,
        default=None,
        help="the cosine decay ends at this step, the LR stays at its floor after it (default: "
        "--steps; with --resume, the first run's: give it to stretch the decay to a new --steps)",
    )
    t.add_argument(
        "--min-lr-ratio",
        type=float,
        default=None,
        help="cosine decay floor as a share of --lr (default 0.1)",
    )
    t.add_argument(
        "--optimizer",
        default=None,
        help="adamw (default), lion, adafactor, sgd (momentum 0.9) or muon (hidden matrices; "
        "AdamW for the rest); adafactor, sgd and muon need --host-precision fp32; --lr and "
        "--weight-decay default per optimizer",
    )
    t.add_argument(
        "--weight-decay",
        type=float,
        default=None,
        help="weight decay of matrices (default: AdamW and Muon 0.1, Lion 0.3, Adafactor and SGD 0)",
    )
    t.add_argument(
        "--clip-grad",
        type=float,
        default=None,
        help="global gradient-norm limit, 0 for none (default 1.0)",
    )
    t.add_argument(
        "--seed", type=int, default=None, help="seed of initialisation and data order (default 0)"
    )
    t.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="validation every N steps, 0: only at the end (default: steps/5; 0 below 25 steps)",
    )
    t.add_argument(
        "--eval-batches",
        type=int,
        default=None,
        help="micro-batches per validation (default: all validations within a quarter of "
        "the training micro-batches, 1 to 8)",
    )
    t.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="share of the corpus held out (default 0.01)",
    )
    t.add_argument(
        "--device-optimizer",
        nargs="?",
        const="on",
        choices=tuple(DEVICE_OPTIMIZER),
        default=None,
        help="auto (default): the planner steps the optimizer of the resident units whose "
        "device step shortens the predicted step (lean host formats; never on the CPU, with "
        "--lora or several ranks); on (or the bare flag): every resident unit whose states "
        "fit ramflow's budget (fp32 masters cost 12 bytes per parameter there, bf16 masters "
        "their states only; with several ranks, the units each rank owns, on its GPU); "
        "off: all on the CPU. Same arithmetic as the CPU step",
    )
    _lora_options(t)
    t.add_argument(
        "--fuse-lora",
        action="store_true",
        default=None,
        help="with --lora: compute each LoRA layer as one frozen matmul with the rank-r update "
        "written in its epilogue (ramflow.helpers.fuse_lora); 12%% faster a step at 70B, "
        "4x2048, the same function up to one rounding of the sum",
    )
    _frozen_format_option(t, "the frozen base's weights")
    t.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="data parallelism: start N ranks on this host, one per GPU (gloo on the CPU); "
        "--batch-size is each rank's micro-batch. torchrun --nproc-per-node N -m ramflow "
        "train does the same",
    )
    t.add_argument(
        "--zero-stage",
        type=int,
        choices=[1, 2],
        default=None,
        help="with several ranks: ZeRO stage (default: the plan's, 2)",
    )
    t.add_argument(
        "--dist-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with several ranks: how long a rank waits for the others in a collective "
        "before failing (default 600; while rank 0 writes a checkpoint's weights, the "
        "others wait up to 2 hours unless it dies)",
    )
    t.add_argument(
        "--numa-binding",
        choices=NUMA_BINDINGS,
        default=None,
        help="with several ranks on GPUs: the cores each rank and its threads are bound to, by "
        "PyTorch's NUMA binding (default exclusive: its own share of the cores of its GPU's "
        "NUMA node, where its optimizer states and pinned buffers then live; none: unbound)",
    )
    t.add_argument(
        "--out", metavar="DIR", default=None, help="run folder (default: runs/<timestamp>)"
    )
    t.add_argument(
        "--resume", metavar="DIR", default=None, help="continue from a run or checkpoint folder"
    )
    t.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (a bar on a terminal, else a line every twentieth of the run)",
    )
    t.add_argument(
        "--log-to",
        "--report-to",
        dest="log_to",
        action="append",
        choices=list(TRACKERS),
        default=[],
        help="also log to tensorboard (run folder/tensorboard), wandb (WANDB_MODE=offline "
        "works) or mlflow (MLFLOW_TRACKING_URI, default ./mlruns); repeat for several; each "
        "needs its package; log.jsonl is always written",
    )
    # fine-tuners' inputs (issue 49): see [Note: a config file is command-line flags]
    t.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="read flags from a YAML or JSON file (keys as the flags, '-' or '_'; a run "
        "folder's run.json replays that run); flags on the command line override it",
    )

    g = sub.add_parser(
        "generate",
        help="continue prompts with a trained or Hugging Face checkpoint",
        description="Generate text with offloaded weights and a KV cache; several prompts run as one batch.",
    )
    g.add_argument(
        "--model",
        metavar="DIR",
        required=True,
        help="run folder, checkpoint folder, Hugging Face model folder or a Hub id org/name "
        "from the local cache",
    )
    g.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    g.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="tokens to generate per prompt (default 128)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 for greedy (default), else sampling temperature",
    )
    g.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="sample among the k most likely tokens (default 0: all)",
    )
    g.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: all)"
    )
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    g.add_argument(
        "--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens"
    )
    g.add_argument(
        "--tokenizer", metavar="DIR", default=None, help="tokenizer folder (default: the model's)"
    )
    g.add_argument(
        "--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)"
    )
    g.add_argument(
        "--precision",
        choices=COMPUTE_PRECISIONS,
        default="auto",
        help="compute precision",
    )
    g.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        default=None,
        help="cap on the weights ramflow keeps on the device",
    )
    _frozen_format_option(g, "the weights")

    pl = sub.add_parser(
        "plan",
        help="print the memory plan and predicted step time of a training run, allocating nothing",
        description="Print GPU, CPU RAM (pinned and pageable) and disk needs of a training run, "
        "from the model's shapes on the meta device, and whether it fits this machine; for a "
        "GPU run also the predicted step time and the fastest plan for the budget. The first "
        "line says whether the run fits and why; then the budget, the plan, and the details.",
        epilog="exit status: 0 the run fits this machine, 1 it does not (its RAM, its disk, "
        "or a --gpu-memory too small for the run: the first line says which, and the "
        "smallest budget that works), 2 a usage or input error",
    )
    _model_options(pl)
    _shape_options(pl)
    pl.add_argument(
        "--out", metavar="DIR", default=None, help="where checkpoints would go, for the disk check"
    )
    _run_length_options(pl, resume=False)
    _lora_options(pl)
    _frozen_format_option(pl, "the frozen base's weights")
    pl.add_argument(
        "--clip-grad",
        type=float,
        default=None,
        help="as train's (default 1.0): a loop that clips, accumulates (--grad-accum) or runs "
        "one process keeps a full host gradient buffer, which the plan counts",
    )
    pl.add_argument(
        "--grad-accum", type=int, default=None, help="as train's: micro-batches per step"
    )
    pl.add_argument(
        "--pcie-gbps",
        type=float,
        default=None,
        metavar="GB/S",
        help="pinned host-device copy rate, each way, for the step-time prediction "
        "(default 55.3, an H200 box's PCIe 5.0 x16)",
    )
    pl.add_argument(
        "--gpu-tflops",
        type=float,
        default=None,
        metavar="TFLOP/S",
        help="the GPU's dense bf16 matmul rate as measured (default 790, an H200's)",
    )
    pl.add_argument(
        "--cpu-adamw-gparams",
        type=float,
        default=None,
        metavar="G/S",
        help="the host's AdamW rate in billions of parameters per second (default 3.72: 16 threads)",
    )
    pl.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="plan N ranks on this host: one rank's GPU as above, the host's RAM for all "
        "of them, and (GPU plans) their predicted tokens/s and what binds",
    )
    pl.add_argument(
        "--zero-stage",
        type=int,
        choices=[1, 2],
        default=None,
        help="with --nproc-per-node: ZeRO stage (default: the plan's, 2)",
    )
    pl.add_argument(
        "--host-dram-gbps",
        type=float,
        default=None,
        metavar="GB/S",
        help="with --nproc-per-node: host DRAM traffic, bytes read plus written per second "
        "(default 192; docs/speed.md says why)",
    )
    pl.add_argument(
        "--host-cores",
        type=int,
        default=None,
        metavar="N",
        help="with --nproc-per-node: the host's CPU cores, for a plan of another machine "
        "(default: this machine's)",
    )
    pr = sub.add_parser(
        "profile",
        help="run a few training steps and write where their memory went",
        description="Run a few training steps of a preset or --model on random tokens and "
        "write, into --out: the activation report (activations.txt), a memory timeline per "
        "variant (timeline-*.png), the CUDA allocator snapshot of the last step "
        "(snapshot-*.pickle, CUDA only; open it at https://pytorch.org/memory_viz) and "
        "summary.json. --offload runs the model plain and offloaded, side by side.",
    )
    _model_options(pr)
    pr.add_argument("--out", metavar="DIR", required=True, help="output folder")
    pr.add_argument(
        "--steps",
        type=int,
        default=5,
        help="training steps per variant (default 5); the report gives the first step and "
        "the steady step, the mean of the later ones",
    )
    pr.add_argument(
        "--batch-size", type=int, default=2, help="sequences per micro-batch (default 2)"
    )
    pr.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    pr.add_argument(
        "--offload",
        action="store_true",
        help="also run the model with ramflow.offload, beside the plain run",
    )
    return parser


def _profile(args: argparse.Namespace) -> int:
    from ..train.profile import profile_model

    result = profile_model(
        out_dir=args.out,
        preset=args.preset,
        model=args.model,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        device=args.device,
        precision=args.precision or "auto",
        gpu_memory=args.gpu_memory,
        offload=args.offload,
    )
    print(result.describe())
    return 0


# [Note: expandable segments by default in ramflow train]
# At long sequences the caching allocator's fixed segments strand memory: an 8B model at
# 128k tokens with checkpointing alone ran out with gigabytes reserved but unallocated, within
# its plan (docs/speed.md, "Expandable segments in ramflow train"). PyTorch's expandable
# segments (CUDA virtual memory management) grow one segment instead, which is the remedy its own
# message names; torchtitan's launcher sets it too. It cannot share memory through CUDA IPC,
# which ramflow does not use (ranks share the host store, not device memory). So
# ``ramflow train`` sets it in its process, and the ranks it launches inherit it, unless the
# user set PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF; the library leaves a user's own
# process alone.
ALLOC_CONF_DEFAULT = "expandable_segments:True"


def default_allocator_settings(environ: MutableMapping[str, str]) -> str | None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to ``ALLOC_CONF_DEFAULT`` in ``environ`` unless the user
    set it or ``PYTORCH_ALLOC_CONF``; returns the setting in force (None: PyTorch's own).
    See [Note: expandable segments by default in ramflow train]."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if name in environ:
            return environ[name] or None
    environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF_DEFAULT
    return ALLOC_CONF_DEFAULT


def _with_config_file(argv: Sequence[str], path: str) -> list[str]:
    """``argv`` with the flags of the ``--config`` file before the command line's own (which
    override them), and ``--config`` taken out. See [Note: a config file is command-line
    flags] in ``ramflow.train.config_file``."""
    from ..train.config_file import Flag, config_argv, read_config_file

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    flags = {
        a.dest: Flag(
            max(a.option_strings, key=len),
            a.dest,
            a.nargs != 0,
            tuple(a.choices) if a.choices else None,
        )
        for a in sub.choices["train"]._actions  # argparse keeps a parser's flags there
        if a.option_strings and a.dest != "help"
    }
    words = config_argv(read_config_file(path), flags, where=path)
    rest, skip = [], False
    for w in argv[argv.index("train") + 1 :]:
        if not skip and w == "--config":
            skip = True
        elif not skip and not w.startswith("--config="):
            rest.append(w)
        else:
            skip = False
    return ["train", *words, *rest]


def _train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import os

    if args.config is not None:
        argv = _with_config_file(argv, args.config)
        args = build_parser().parse_args(argv)
    from ..train.launch import follow_launcher

    follow_launcher()  # a rank of --nproc-per-node dies with its launcher
    # before anything initializes CUDA; the ranks a launcher starts inherit it
    default_allocator_settings(os.environ)
    from ..train import TrainConfig, open_checkpoint, resume_config, train
    from ..train.ranks import DEFAULT_TIMEOUT_S

    timeout_s = args.dist_timeout if args.dist_timeout is not None else DEFAULT_TIMEOUT_S
    if args.nproc_per_node is not None and "WORLD_SIZE" not in os.environ:
        # the launcher: see [Note: the launcher] in ramflow.train.launch
        from ..train.launch import launch

        if args.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
        return launch(list(argv), nproc=args.nproc_per_node, timeout_s=timeout_s)
    if args.nproc_per_node is not None and os.environ.get("LOCAL_WORLD_SIZE") != str(
        args.nproc_per_node
    ):
        raise ValueError(
            f"--nproc-per-node {args.nproc_per_node} inside a launched run of "
            f"{os.environ.get('LOCAL_WORLD_SIZE')} ranks per host: leave it out under torchrun"
        )
    options: dict[str, Any] = {k: getattr(args, k) for k in _TRAIN_OPTIONS}
    options["device_optimizer"] = DEVICE_OPTIMIZER.get(args.device_optimizer)
    run_options: dict[str, Any] = {
        "out": args.out,
        "progress": not args.no_progress,
        "log_to": args.log_to,
        "zero_stage": args.zero_stage,
        "dist_timeout_s": timeout_s,
    }
    if args.numa_binding is not None:
        run_options["numa_binding"] = args.numa_binding
    if args.resume is not None:
        from pathlib import Path

        from ..train.run_checkpoint import run_folder_of
        from ..train.run_lock import RunLock

        # a run saving into the folder is refused before its checkpoint is read (train
        # takes the lock for the run itself): see [Note: the run folder's lock]
        folder = Path(args.out) if args.out is not None else run_folder_of(args.resume)
        if folder.is_dir():
            RunLock(folder).acquire().release()
        ckpt = open_checkpoint(args.resume)
        config = resume_config(ckpt, **options)
        result = train(config, resume=ckpt, **run_options)
    else:
        config = TrainConfig.from_options(**options)
        result = train(config, **run_options)
    if not result.interrupted:
        return 0
    return 128 + (result.stop_signal or signal.SIGINT)  # the shell's convention


def _generate(args: argparse.Namespace) -> int:
    import ramflow

    from ..train import SamplingConfig, generate, load_for_generation

    sampling = SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_at_eos=not args.ignore_eos,
    )
    model, tokenizer, policy = load_for_generation(
        args.model,
        tokenizer=args.tokenizer,
        device=args.device,
        precision=args.precision,
        gpu_memory=args.gpu_memory,
        frozen_format=args.frozen_format,
    )
    try:
        results = generate(model, tokenizer, args.prompt, sampling=sampling, policy=policy)
    finally:
        ramflow.synchronize(model)
    for i, r in enumerate(results, start=1):
        print(f"--- prompt {i} ({len(r.token_ids)} new tokens) ---")
        print(r.prompt + r.text)
    return 0


def _model_label(args: argparse.Namespace) -> str:
    """What the plan's first line names: the model folder or the preset."""
    return str(args.model) if args.model else (args.preset or "tiny")


def _plan(args: argparse.Namespace) -> int:
    from ..train import TrainConfig, plan_run

    options = {
        k: getattr(args, k)
        for k in (
            "preset",
            "model",
            "tokenizer",
            "device",
            "precision",
            "gpu_memory",
            "batch_size",
            "global_batch",
            "seq_len",
            "checkpointing",
            "host_precision",
            "clip_grad",
            "grad_accum",
            "lora_rank",
            "lora_targets",
            "frozen_format",
            "steps",
            "save_every",
            "keep_checkpoints",
        )
    }
    from ..planner.predict import DEFAULT_CPU_OPTIMIZER_PARAMS_PER_S, Rates

    for flag, value in (
        ("--pcie-gbps", args.pcie_gbps),
        ("--gpu-tflops", args.gpu_tflops),
        ("--cpu-adamw-gparams", args.cpu_adamw_gparams),
    ):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    cpu = (args.cpu_adamw_gparams or DEFAULT_CPU_OPTIMIZER_PARAMS_PER_S / 1e9) * 1e9
    rates = (
        Rates.from_pcie(args.pcie_gbps * 1e9, cpu_optimizer_params_per_s=cpu)
        if args.pcie_gbps
        else Rates(cpu_optimizer_params_per_s=cpu)
    )
    from ..memory.estimate import BudgetTooSmall

    try:
        estimate = plan_run(
            TrainConfig.from_options(**options),
            out_dir=args.out,
            timing_rates=rates,
            matmul_flops_per_s=args.gpu_tflops * 1e12 if args.gpu_tflops else None,
            num_ranks=args.nproc_per_node or 1,
            zero_stage=args.zero_stage,
        )
    except BudgetTooSmall as err:  # a verdict, not a usage error: see the exit status
        print(f"{_model_label(args)}: DOES NOT FIT this budget: {err}")
        return 1
    ranks = None
    if args.nproc_per_node is not None and args.nproc_per_node > 1:
        from ..train.scale import DEFAULT_HOST_DRAM_BYTES_PER_S, plan_ranks

        if args.host_dram_gbps is not None and args.host_dram_gbps <= 0:
            raise ValueError(f"--host-dram-gbps must be positive, got {args.host_dram_gbps}")
        if args.host_cores is not None and args.host_cores < 1:
            raise ValueError(f"--host-cores must be at least 1, got {args.host_cores}")
        ranks = plan_ranks(
            estimate,
            num_ranks=args.nproc_per_node,
            zero_stage=args.zero_stage,
            host_dram_bytes_per_s=(
                args.host_dram_gbps * 1e9 if args.host_dram_gbps else DEFAULT_HOST_DRAM_BYTES_PER_S
            ),
            cores=args.host_cores,
        )
    from ..train.plan_report import describe_plan, fits

    print(describe_plan(estimate, ranks))
    return 0 if fits(estimate, ranks) else 1


def _answered_in_one_line() -> tuple[type[BaseException], ...]:
    """User mistakes, machine limits and a diverging loss: a message that says what to
    change, no traceback. ``LossDiverged`` is raised only by the training loop, so it is
    named only once the loop's module is loaded: the parser imports no PyTorch."""
    loop = sys.modules.get("ramflow.train.loop")
    return (ValueError, MemoryError, OSError) + ((loop.LossDiverged,) if loop else ())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ramflow`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    handlers = {
        "train": lambda a: _train(a, argv),
        "generate": _generate,
        "plan": _plan,
        "profile": _profile,
    }
    try:
        return handlers[args.command](args)
    except _answered_in_one_line() as err:
        print(f"ramflow {args.command}: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        if err.name in TRACKERS.values():  # --report-to's packages
            print(f"ramflow {args.command}: error: {err}", file=sys.stderr)
            return 2
        if err.name != "transformers":
            raise
        print(
            f"ramflow {args.command}: error: this command needs transformers; "
            "install it with: pip install 'ramflow[hf]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"ramflow {args.command}: aborted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
