"""A full fine-tune of a Llama shape on every GPU of a host, in your own loop: the Python API
of ``ramflow train --preset llama-70b --nproc-per-node N``.

    torchrun --standalone --nproc-per-node 4 examples/llama_torchrun.py --size 70b \\
        --batch-size 4 --seq-len 4096 --gpu-memory 97GiB --steps 6 --out 70b.json
    torchrun --standalone --nproc-per-node 2 examples/llama_torchrun.py   # tiny, gloo on CPUs

Every rank builds the model on the meta device (``LlamaForCausalLM`` of a ``LlamaConfig``
with the shapes of ramflow's presets: no memory) and hands ``ramflow.offload`` its values
with ``weights=``: a safetensors folder (``--weights DIR``, e.g. Llama-3.1-70B's) or, by
default, the presets' seeded random init (``SeededInit``). With ``zero_stage`` the ranks of
a host fill one shared host copy once, each the units it steps, so no rank ever holds a
whole model: 70B in lean host formats is about 4 bytes per parameter of host RAM for the
whole host. The loop is the one-GPU loop plus a ``DistributedSampler``:

- ``ramflow.optim.AdamW``, decay on matrices only, warmup and cosine decay (``ramflow
  train``'s recipe and defaults);
- the stdlib corpus (``--data`` for your own text) tokenized by bytes, as ``ramflow train``
  tokenizes it for its presets (with a real checkpoint's weights, tokenize with its own
  tokenizer instead), cut into sequences of ``--seq-len``, dealt out by
  ``DistributedSampler``, seeded so that each step's global batch is the one ``ramflow
  train --seed S`` trains on;
- the loss in chunks (``chunk_lm_head``/``lm_loss``: never the (B, T, 128256) fp32
  logits), bf16 autocast on GPUs (the CPU computes in the wire dtype: fp32, or bf16 with
  lean host formats, as ``ramflow train`` does);
- no gradient clipping: each unit steps on the host as soon as its gradients have landed,
  during backward, which a global norm (known only after the last unit) would forbid;
  clipping would also keep a full host gradient buffer (2 bytes per parameter: 131 GiB at
  70B). Turn it on with ``ramflow.clip_grad_norm_`` before ``opt.step()`` if you need it.

Rank 0 prints the load time and, per step, the loss, step time, tokens/s of all ranks and
peak GPU memory; ``--out FILE`` writes them as json. ``--gpu-memory`` is ramflow's own
share of each GPU (activations not included): ``ramflow plan --preset llama-70b
--nproc-per-node 4 --host-precision lean --batch-size 4 --seq-len 4096 --checkpointing on
--clip-grad 0`` prints it ("of its ... share"); without it every unit streams.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import statistics
import time
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM

import ramflow
from ramflow.choices import NUMA_BINDINGS
from ramflow.train.data import build_corpus, epoch_order_seed, find_documents
from ramflow.train.initialization import SeededInit
from ramflow.train.loss import chunk_lm_head, lm_loss
from ramflow.train.lr_schedule import default_warmup_steps, warmup_cosine
from ramflow.train.presets import get_preset
from ramflow.train.ranks import bind_to_gpu_node
from ramflow.train.tokenizer import ByteTokenizer

# --size: the ramflow preset whose shape (Meta's config.json for the Llama ones) and
# defaults (sequences per rank, tokens, peak LR) this example trains
SIZES = {"tiny": "tiny", "8b": "llama-8b", "70b": "llama-70b"}


def llama_config(size: str, tokenizer: ByteTokenizer) -> LlamaConfig:
    """The ``LlamaConfig`` of ``size`` (its preset's), with the tokenizer's special ids."""
    return get_preset(SIZES[size]).to_config(
        vocab_size=tokenizer.vocab_size,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )


class TokenSequences(Dataset):
    """A (N,) token stream cut into N // T sequences of T tokens, each a (T,) int64 tensor."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return self.tokens.numel() // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.seq_len : (i + 1) * self.seq_len].long()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=list(SIZES), default="tiny")
    p.add_argument(
        "--weights",
        metavar="DIR",
        help="safetensors of the --size shape (a folder, index or file); default: the "
        "presets' seeded random init from --seed",
    )
    p.add_argument("--data", help="text file, folder or JSON lines; default: the stdlib corpus")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument(
        "--warmup-steps", type=int, help="default: a fifth of --steps, at most 200, at least 1"
    )
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1, help="of matrices only")
    p.add_argument("--host-precision", default="lean", help="fp32, bf16, lean or kahan")
    p.add_argument("--zero-stage", type=int, choices=[1, 2], default=2)
    p.add_argument("--checkpointing", choices=["on", "off"], default="on")
    p.add_argument("--gpu-memory", help="ramflow's share of each GPU, e.g. 97GiB")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument(
        "--numa-binding",
        choices=NUMA_BINDINGS,
        default="exclusive",
        help="on GPUs, the cores of each rank (as ramflow train's --numa-binding)",
    )
    p.add_argument("--threads", type=int, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=600.0, help="process group timeout (s)")
    p.add_argument("--seed", type=int, default=0, help="of the init and the data order")
    p.add_argument("--out", help="rank 0 writes the summary here (json)")
    args = p.parse_args(argv)
    preset = get_preset(SIZES[args.size])
    for name in ("batch_size", "seq_len", "lr"):  # ramflow train's defaults for the preset
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.warmup_steps is None:
        args.warmup_steps = default_warmup_steps(args.steps)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # started without torchrun: a world of one process
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    cpus = None
    if cuda:
        if torch.cuda.device_count() < local_world:
            raise SystemExit(f"{local_world} ranks on this host, {torch.cuda.device_count()} GPUs")
        # long sequences fragment PyTorch's cache; ramflow train sets the same
        if "PYTORCH_ALLOC_CONF" not in os.environ:
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # the host optimizer's threads, states and pinned buffers near this rank's GPU
        cpus = bind_to_gpu_node(local_rank, args.numa_binding)
    else:
        device = torch.device("cpu")
    # torchrun sets OMP_NUM_THREADS=1; the host optimizer wants this rank's cores
    torch.set_num_threads(
        args.threads or (len(cpus) if cpus else max(1, (os.cpu_count() or 1) // local_world))
    )
    # NCCL between GPUs, gloo between CPU processes (as ramflow train)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    # ---- data: every rank tokenizes the same corpus; the sampler gives each its rows
    tokenizer = ByteTokenizer()
    corpus = build_corpus(find_documents(args.data), tokenizer, seq_len=args.seq_len)
    dataset = TokenSequences(corpus.train_tokens, args.seq_len)
    sampler = DistributedSampler(
        dataset, num_replicas=world, rank=rank, seed=epoch_order_seed(args.seed), drop_last=True
    )
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    # ---- model: built on the meta device, filled into the host store by the ranks
    t_load = time.perf_counter()
    config = llama_config(args.size, tokenizer)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    weights = args.weights or SeededInit(model, seed=args.seed)
    t_offload = time.perf_counter()
    ramflow.offload(
        model,
        device=device,
        zero_stage=args.zero_stage,
        host_precision=args.host_precision,
        weights=weights,
        gpu_memory=args.gpu_memory,
        activation_checkpointing=args.checkpointing == "on",
    )
    model.train()
    chunk_lm_head(model)  # lm_loss computes the loss C tokens at a time
    t_optimizer = time.perf_counter()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = ramflow.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        keep_grads=False,  # the loop never reads p.grad: steps in backward write none
    )
    schedule = warmup_cosine(
        warmup_steps=args.warmup_steps, total_steps=args.steps, min_lr_ratio=args.min_lr_ratio
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    load_s = time.perf_counter() - t_load
    # where the load went (s): the optimizer's states are made when it is built
    load_phases = {
        "build_s": t_offload - t_load,
        "offload_s": t_optimizer - t_offload,
        "optimizer_s": t_load + load_s - t_optimizer,
    }
    num_params = sum(p.numel() for p in model.parameters())
    plan = ramflow.get_plan(model)
    say(
        f"{args.size}: {num_params / 1e6:,.1f} M parameters, {world} ranks ({backend}, ZeRO-"
        f"{args.zero_stage}), {args.host_precision} host formats, {len(plan.resident)} of "
        f"{len(plan.unit_names)} units resident; loaded in {load_s:.1f} s"
    )
    say(
        f"data {args.data or 'the stdlib corpus'}: {len(dataset):,} sequences of "
        f"{args.seq_len} tokens, {args.batch_size} per rank and step"
    )

    tokens_per_step = world * args.batch_size * args.seq_len
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    since_start_s = time.time() - psutil.Process().create_time()
    records: list[dict] = []
    epoch = 0
    while len(records) < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            t0 = time.perf_counter()
            # bf16 autocast on GPUs; the CPU computes in the wire dtype, as ramflow train
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = lm_loss(model, batch.to(device))  # (B, T) ids -> mean loss, fp32
            t1 = time.perf_counter()
            loss.backward()  # units step on the host as their gradients land
            t2 = time.perf_counter()
            opt.step()  # returns at once; the next forward waits where it must
            opt.zero_grad()
            sched.step()
            t3 = time.perf_counter()
            mean = loss.detach()
            dist.all_reduce(mean)
            record = {
                "step": len(records) + 1,
                "loss": mean.item() / world,
                "step_s": time.perf_counter() - t0,
                # wall seconds of the step's calls on rank 0 (the GPU runs behind them;
                # the loss's sync waits for it): where a slow step spent its time
                "phases_s": {
                    "forward": t1 - t0,
                    "backward": t2 - t1,
                    "optimizer_step": t3 - t2,
                    "loss_sync": time.perf_counter() - t3,
                },
                "host_rss_bytes": psutil.Process().memory_info().rss,
            }
            record["tokens_per_s"] = tokens_per_step / record["step_s"]
            record["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device) if cuda else None
            records.append(record)
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"the loss became {record['loss']}")
            peak = f", peak GPU {record['peak_gpu_bytes'] / 2**30:.1f} GiB" if cuda else ""
            say(
                f"step {record['step']}/{args.steps}  loss {record['loss']:.4f}  "
                f"{record['step_s']:.2f} s  {record['tokens_per_s']:,.0f} tokens/s{peak}"
            )
            if len(records) == args.steps:
                break
        epoch += 1

    # every rank: the last step's sync with the other ranks may still run on ramflow's
    # host worker, on a group that destroy_process_group would pull from under it
    ramflow.synchronize(model)
    gathered: list = [None] * world
    peak_gpu = torch.cuda.max_memory_allocated(device) if cuda else None
    host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    dist.all_gather_object(gathered, (peak_gpu, host_peak))
    timed = [r["step_s"] for r in records[2:]] or [r["step_s"] for r in records]
    summary = {
        "size": args.size,
        "num_parameters": num_params,
        "world_size": world,
        "backend": backend,
        "zero_stage": args.zero_stage,
        "host_precision": args.host_precision,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "weights": args.weights or f"seeded init, seed {args.seed}",
        "corpus_fingerprint": corpus.fingerprint,
        "resident_units": len(plan.resident),
        "load_s": load_s,
        "load_phases_s": load_phases,
        "since_start_s": since_start_s,
        "step_s": statistics.median(timed),
        "tokens_per_s": tokens_per_step / statistics.median(timed),
        "peak_gpu_bytes_per_rank": [g for g, _ in gathered],
        "peak_rss_bytes_per_rank": [h for _, h in gathered],
        "steps": records,
    }
    say(
        f"median step {summary['step_s']:.2f} s"
        + (" (of the steps after the first two)" if len(records) > 2 else "")
        + f", {summary['tokens_per_s']:,.0f} tokens/s"
    )
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
