"""Fine-tune a Flux diffusion transformer (diffusers) with its weights in CPU RAM.

The loop is diffusers' ``train_dreambooth_flux.py`` step, rectified flow matching (Esser et
al. 2024; Liu et al. 2022): latents (B, C, H, W) packed 2x2 into tokens, x_t = (1 - t) x0 +
t noise at a logit-normal t, loss = MSE(model(x_t), noise - x0), under accelerate's
``Accelerator``. Only ``ramflow.offload`` and ``ramflow.optim.AdamW`` are ramflow's: each
double- and single-stream block streams through the GPU as a unit.

Random latents and text embeddings stand in for a VAE and text encoders. The default is a
tiny Flux that runs in seconds on a CPU; on a GPU, raise the sizes (Flux-dev: --double 19
--single 38 --heads 24 --head-dim 128 --text-dim 4096 --pooled-dim 768 --latent-size 128
--text-tokens 512, about 12B parameters; build it on the meta device with weights= for a
checkpoint, as benchmarks/dit/dit_flux.py does).

    python examples/train_flux_dit.py --steps 4
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from diffusers import FluxPipeline, FluxTransformer2DModel
from diffusers.training_utils import compute_density_for_timestep_sampling

import ramflow


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Sizes default to a tiny model; the module docstring gives Flux-dev's.",
    )
    p.add_argument("--steps", type=int, default=4, help="optimizer steps")
    p.add_argument("--batch", type=int, default=2, help="images per step")
    p.add_argument("--double", type=int, default=2, help="double-stream blocks")
    p.add_argument("--single", type=int, default=4, help="single-stream blocks")
    p.add_argument("--heads", type=int, default=2, help="attention heads")
    p.add_argument("--head-dim", type=int, default=16, help="dims per head (hidden = heads x this)")
    p.add_argument("--latent-channels", type=int, default=4, help="VAE latent channels (Flux: 16)")
    p.add_argument("--latent-size", type=int, default=8, help="latent height = width (even)")
    p.add_argument("--text-tokens", type=int, default=8, help="T5 tokens per image")
    p.add_argument("--text-dim", type=int, default=32, help="T5 embedding dims")
    p.add_argument("--pooled-dim", type=int, default=24, help="CLIP pooled dims")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--gpu-memory", default=None, help='ramflow\'s device budget, e.g. "24GiB"')
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is")
    args = p.parse_args()
    if args.latent_size % 2:
        p.error(f"--latent-size must be even (2x2 packing), got {args.latent_size}")
    rope = args.head_dim // 8 * 2  # Flux splits each head's dims over 3 rotary axes
    axes = (args.head_dim - 2 * rope, rope, rope)

    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        # cuDNN's attention backward has returned NaN gradients in bf16 (pytorch/pytorch#196678,
        # diffusers#9768). On an H100 with torch 2.11 this loop's timestep-embedder gradients
        # went NaN at the second step with the model resident too; flash and memory-efficient
        # attention take over without it.
        torch.backends.cuda.enable_cudnn_sdp(False)
    accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda else "no")
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        in_channels=4 * args.latent_channels,
        num_layers=args.double,
        num_single_layers=args.single,
        attention_head_dim=args.head_dim,
        num_attention_heads=args.heads,
        joint_attention_dim=args.text_dim,
        pooled_projection_dim=args.pooled_dim,
        guidance_embeds=True,
        axes_dims_rope=axes,
    )
    model = ramflow.offload(
        model,
        device=accelerator.device,
        gpu_memory=args.gpu_memory,
        activation_checkpointing=args.checkpointing,
    )
    opt = ramflow.optim.AdamW(model.parameters(), lr=args.lr)
    model, opt = accelerator.prepare(model, opt)

    b, c, s = args.batch, args.latent_channels, args.latent_size
    img_ids = FluxPipeline._prepare_latent_image_ids(
        b, s // 2, s // 2, accelerator.device, torch.float32
    )
    txt_ids = torch.zeros(args.text_tokens, 3, device=accelerator.device)
    for step in range(args.steps):
        x0 = torch.randn(b, c, s, s, device=accelerator.device)  # (B, C, H, W) latents
        noise = torch.randn_like(x0)
        t = compute_density_for_timestep_sampling(
            "logit_normal", b, logit_mean=0.0, logit_std=1.0, device=accelerator.device
        )
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        with accelerator.autocast():
            pred = model(
                hidden_states=FluxPipeline._pack_latents(xt, b, c, s, s),  # (B, L, 4C)
                timestep=t,
                guidance=torch.full((b,), 3.5, device=accelerator.device),
                pooled_projections=torch.randn(b, args.pooled_dim, device=accelerator.device),
                encoder_hidden_states=torch.randn(
                    b, args.text_tokens, args.text_dim, device=accelerator.device
                ),
                txt_ids=txt_ids,
                img_ids=img_ids,
                return_dict=False,
            )[0]
        target = FluxPipeline._pack_latents(noise - x0, b, c, s, s)
        loss = F.mse_loss(pred.float(), target.float())
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")
    ramflow.synchronize(model)
    plan = ramflow.get_plan(model)
    blocks = [n for n in plan.unit_names if "transformer_blocks." in n]
    print(f"{len(plan.unit_names)} units, {len(blocks)} of them blocks; {plan.describe()}")


if __name__ == "__main__":
    main()
