"""Quality of compressed frozen weights on real weights (issue 16, point 3).

1. ``ramflow train`` trains a small preset on the stdlib corpus, so its weights are real.
2. Its checkpoint is loaded frozen with ``ramflow.offload(frozen_format=...)`` in bf16 (the
   wire dtype), int8 and nf4; the validation perplexity of each is compared with bf16
   (targets: int8 within 1%, nf4 within 5%).
3. ``ramflow train --lora`` tunes adapters for the same steps on a bf16 base and on an int8
   base (``--frozen-format int8``); final validation losses (target: within 1%).

A format that cannot run here (NF4 without torchao) is skipped, and the report says
why. Writes ``frozen_quality.json`` and ``frozen_quality.md``
under ``--out-dir``. ``--smoke`` runs it all on the CPU in about a minute (tested in CI).

    python benchmarks/frozen_quality/frozen_quality.py --out-dir benchmarks/results/<date>-frozen-quality
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: the harness's modules
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

import ramflow  # noqa: E402
from ramflow.train.data import build_corpus, find_documents  # noqa: E402
from ramflow.train.generation import load_for_generation  # noqa: E402
from ramflow.train.report import read_log  # noqa: E402
from ramflow.train.trainer import evaluate  # noqa: E402
from smoke_corpus import smoke_corpus  # noqa: E402

TARGETS = {"int8": 0.01, "nf4": 0.05}  # relative perplexity over bf16's
LORA_TARGET = 0.01  # LoRA on an int8 base: relative validation loss over a bf16 base's


def ramflow_train(args: list[str], out: Path) -> dict[str, Any]:
    """Run ``ramflow train`` in a child process; its return code and final validation loss."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "ramflow", "train", *args, "--no-progress", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    evals = (
        [r for r in read_log(out / "log.jsonl") if r.get("event") == "eval"]
        if (out / "log.jsonl").exists()
        else []
    )
    return {
        "returncode": proc.returncode,
        "seconds": round(time.perf_counter() - t0, 1),
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "error": proc.stderr[-2000:] if proc.returncode else None,
    }


def frozen_perplexity(
    run: Path,
    *,
    data: Path | None,
    frozen_format: str | None,
    device: str | None,
    seq_len: int,
    batches: int,
) -> float:
    """Validation perplexity of the run's last checkpoint, every weight frozen, on the
    validation part of ``data`` (None: the standard library, ``ramflow train``'s default)."""
    model, tok, policy = load_for_generation(run, device=device, frozen_format=frozen_format)
    try:
        corpus = build_corpus(find_documents(data), tok, seq_len=seq_len, val_fraction=0.01)
        loss = evaluate(
            model, corpus.val_tokens, policy=policy, batch_size=4, seq_len=seq_len,
            max_batches=batches,
        )  # fmt: skip
    finally:
        ramflow.undo(model)
    return math.exp(loss)


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"# Compressed frozen weights: quality ({meta['preset']}, {meta['steps']} steps, "
        f"device {meta['device']})",
        "",
        "| frozen weights | val perplexity | vs bf16 | target | ok |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["perplexity"].items():
        if row.get("skipped"):
            lines.append(f"| {name} | - | - | - | skipped: {row['skipped']} |")
            continue
        rel = row.get("rel_to_bf16")
        target = TARGETS.get(name)
        ok = "" if target is None or rel is None else ("yes" if rel <= target else "no")
        lines.append(
            f"| {name} | {row['perplexity']:.4f} | "
            f"{'-' if rel is None else f'{rel * 100:+.2f}%'} | "
            f"{'-' if target is None else f'<= {target * 100:.0f}%'} | {ok} |"
        )
    lines += [
        "",
        "| LoRA base | final val loss | vs bf16 base | target | ok |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["lora"].items():
        if row.get("skipped") or row.get("final_val_loss") is None:
            why = row.get("skipped") or f"failed (rc {row.get('returncode')})"
            lines.append(f"| {name} | - | - | - | {why} |")
            continue
        rel = row.get("rel_to_bf16")
        ok = "" if name == "bf16" or rel is None else ("yes" if rel <= LORA_TARGET else "no")
        target = "-" if name == "bf16" else f"<= {LORA_TARGET * 100:.0f}%"
        lines.append(
            f"| {name} | {row['final_val_loss']:.4f} | "
            f"{'-' if rel is None else f'{rel * 100:+.2f}%'} | {target} | {ok} |"
        )
    for note in result["notes"]:
        lines.append(f"\n{note}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=600, help="steps of the base run and of LoRA")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--device", default=None)
    p.add_argument("--data", type=Path, default=None, help="corpus (default: the stdlib sources)")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--run-root", type=Path, default=None, help="run folders (default: out-dir)")
    p.add_argument("--smoke", action="store_true", help="a CPU run of about a minute")
    args = p.parse_args(argv)
    out = args.out_dir
    runs = args.run_root or out
    out.mkdir(parents=True, exist_ok=True)
    extra: list[str] = []
    if args.smoke:
        args.steps, args.seq_len, args.eval_batches, args.device = 6, 32, 2, "cpu"
        args.lora_rank = 4
        args.data = args.data or smoke_corpus(out)
        extra = ["--batch-size", "2", "--eval-batches", "1"]
    device_flags = ["--device", args.device] if args.device else []
    notes: list[str] = []
    common = ["--seq-len", str(args.seq_len), "--eval-every", str(args.steps), *extra]
    common += ["--data", str(args.data)] if args.data else []
    base = ramflow_train(
        ["--preset", args.preset, "--steps", str(args.steps), *common, *device_flags],
        runs / "base",
    )
    if base["returncode"]:
        raise SystemExit(f"the base run failed:\n{base['error']}")
    formats: list[str | None] = [None, "int8", "nf4"]
    perplexity: dict[str, Any] = {}
    for fmt in formats:
        name = fmt or "bf16"
        try:
            ppl = frozen_perplexity(
                runs / "base", data=args.data, frozen_format=fmt, device=args.device,
                seq_len=args.seq_len, batches=args.eval_batches,
            )  # fmt: skip
        except (ValueError, ImportError) as err:  # e.g. NF4 without its library
            perplexity[name] = {"skipped": str(err).splitlines()[0][:200]}
            continue
        perplexity[name] = {"perplexity": ppl}
    ref = perplexity["bf16"]["perplexity"]
    for row in perplexity.values():
        if "perplexity" in row:
            row["rel_to_bf16"] = row["perplexity"] / ref - 1
    if args.device == "cpu":
        notes.append("On the CPU the wire dtype is fp32: the bf16 row is fp32 weights.")
    lora: dict[str, Any] = {}
    lora_flags = ["--model", str(runs / "base"), "--lora", str(args.lora_rank), "--lr", "1e-3"]
    lora_flags += ["--steps", str(args.steps), *common, *device_flags]
    for fmt in (None, "int8"):
        name = fmt or "bf16"
        flags = lora_flags + (["--frozen-format", fmt] if fmt else [])
        lora[name] = ramflow_train(flags, runs / f"lora-{name}")
    ref_loss = lora["bf16"].get("final_val_loss")
    for row in lora.values():
        if ref_loss and row.get("final_val_loss") is not None:
            row["rel_to_bf16"] = row["final_val_loss"] / ref_loss - 1
    result = {
        "meta": {
            "preset": args.preset,
            "steps": args.steps,
            "lora_rank": args.lora_rank,
            "seq_len": args.seq_len,
            "device": args.device or "default",
            "data": str(args.data) if args.data else "stdlib",
            "smoke": args.smoke,
        },
        "base_run": base,
        "perplexity": perplexity,
        "lora": lora,
        "targets": {"perplexity": TARGETS, "lora": LORA_TARGET},
        "notes": notes,
    }
    (out / "frozen_quality.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "frozen_quality.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
