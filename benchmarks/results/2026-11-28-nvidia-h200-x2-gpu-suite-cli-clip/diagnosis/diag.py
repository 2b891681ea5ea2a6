# ruff: noqa: E401, E402, I001  (a one-off diagnosis script kept with its results, as it ran)
"""The GPU diagnosis of 2026-11-28 (run from the repository root, PYTHONPATH=src):
    python3 diag.py cuda                       -> diag.txt
    CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -c "import torch; torch.use_deterministic_algorithms(True); \
        import runpy, sys; sys.argv=['diag.py','cuda']; runpy.run_path('diag.py', run_name='__main__')"
                                               -> diag-deterministic.txt
Per run: the losses, which norm the clip used (device norms or host), and per step the fp64 norm
of the host gradients against the norm the clip returned."""

import contextlib, dataclasses, io, shutil, sys, sysconfig
from pathlib import Path

sys.path.insert(0, "tests/train")
sys.path.insert(0, "tests")
import pytest, torch
import ramflow
from ramflow.engine import clip as _clip
from ramflow.engine.stepper import Stepper

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
paths = []
orig_ppn = Stepper.pass_param_norms


def ppn(self):
    r = orig_ppn(self)
    paths.append("host" if r is None else "device")
    return r


Stepper.pass_param_norms = ppn
real_clip = ramflow.clip_grad_norm_
FOLD = [True]
rec = []


def clip(params, max_norm, *a, fold=None, **k):
    params = list(params)
    hn = torch.linalg.vector_norm(
        torch.stack([p.grad.double().norm() for p in params if p.grad is not None])
    )
    r = real_clip(params, max_norm, *a, fold=FOLD[0], **k)
    rec.append((float(hn), float(r), float(r) / float(hn) - 1))
    return r


ramflow.clip_grad_norm_ = clip
from ramflow.train import TrainConfig, train
from ramflow.train.presets import PRESETS
from test_oom_backoff import OOMInjector, _inject, _steps

stdlib = Path(sysconfig.get_paths()["stdlib"])
corpus = Path("/tmp/diag-corpus.txt")
corpus.write_text(
    "".join((stdlib / n).read_text() for n in ("argparse.py", "json/decoder.py", "textwrap.py"))
)
T = 8192 if dev == "cuda" else 512
PRESETS["tiny"] = dataclasses.replace(PRESETS["tiny"], max_position_embeddings=T)
run = dict(steps=3, seq_len=T, batch_size=1, eval_every=0, eval_batches=1, device=dev)
mp = pytest.MonkeyPatch()
for fold in (True, False):
    FOLD[0] = fold
    for name, ck, inj in [
        ("auto", "auto", OOMInjector(limit=1, where="backward", until_offload=True)),
        ("offload", "offload", None),
        ("offload2", "offload", None),
    ]:
        paths.clear()
        rec.clear()
        out = Path("/tmp/diag") / name
        shutil.rmtree(out, ignore_errors=True)
        with mp.context() as m:
            if inj:
                _inject(m, inj)
            cfg = TrainConfig.from_options(data=str(corpus), checkpointing=ck, seed=0, **run)
            with contextlib.redirect_stdout(io.StringIO()):
                train(cfg, out=out, progress=False)
        print(
            f"RESULT fold={fold} {name}: losses {[r['loss'] for r in _steps(out)]} paths {paths} norms(host,returned,rel) {rec}",
            flush=True,
        )
import test_clip_fold as t

for devopt in (False, True):
    for fold in (True, False):
        _clip._FOLD = fold
        model, opt = t.offloaded(torch.device(dev), "fp32", devopt)
        for ids in t.batches(4, torch.device(dev)):
            t.lm_loss(model, ids).backward()
            ps = list(model.parameters())
            hn = torch.linalg.vector_norm(
                torch.stack([p.grad.double().norm() for p in ps if p.grad is not None])
            )
            n = torch.nn.utils.clip_grad_norm_(ps, t.MAX_NORM)
            print(
                f"RESULT clipfold devopt={devopt} fold={fold}: host {float(hn):.9g} returned {float(n):.9g} rel {float(n) / float(hn) - 1:.3g}",
                flush=True,
            )
            opt.step()
            opt.zero_grad()
        ramflow.synchronize(model)
