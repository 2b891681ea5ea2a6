"""Tiny diffusers transformers and their rectified-flow training step, for the parity tests.

The step follows diffusers' ``examples/dreambooth/train_dreambooth_flux.py``: latents
(B, C, H, W) are packed 2x2 into (B, H/2 * W/2, 4C) tokens (``FluxPipeline._pack_latents``),
a time t in (0, 1) is drawn per sample (logit-normal, ``compute_density_for_timestep_sampling``),
x_t = (1 - t) x0 + t noise, the model predicts the velocity noise - x0 and the loss is its
mean squared error (Esser et al. 2024, "Scaling Rectified Flow Transformers", the SD3 paper;
Liu et al. 2022, rectified flow). SD3 takes the latents unpacked.

Legend: B batch, C latent channels, H x W latent size, L image tokens, S text tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel, SD3Transformer2DModel
from diffusers.training_utils import compute_density_for_timestep_sampling

LATENT_CHANNELS = 4
LATENT_HW = 4  # latent height and width: 2x2 packing gives 4 image tokens
TEXT_TOKENS = 6
TEXT_DIM = 32
POOLED_DIM = 24


def tiny_flux(*, guidance: bool = False, double: int = 2, single: int = 3) -> Any:
    """A random-init ``FluxTransformer2DModel`` of the Flux layout (double- then
    single-stream blocks) with 2 heads of 16 dims; ``guidance``: Flux-dev's guidance embed."""
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=POOLED_DIM,
        guidance_embeds=guidance,
        axes_dims_rope=(4, 6, 6),
    )


def tiny_sd3() -> Any:
    """A random-init ``SD3Transformer2DModel`` (MMDiT) with 2 blocks, the last one
    context-pre-only as in SD3, and SD3.5's dual attention in the first."""
    return SD3Transformer2DModel(
        sample_size=LATENT_HW,
        patch_size=2,
        in_channels=LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        caption_projection_dim=16,
        pooled_projection_dim=POOLED_DIM,
        out_channels=LATENT_CHANNELS,
        pos_embed_max_size=8,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )


def flow_batch(seed: int, batch: int = 2) -> dict[str, torch.Tensor]:
    """One batch of random latents, noise, times and text embeddings (CPU, fp32)."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, LATENT_CHANNELS, LATENT_HW, LATENT_HW)  # (B, C, H, W)
    return {
        "x0": torch.randn(shape, generator=g),
        "noise": torch.randn(shape, generator=g),
        "t": compute_density_for_timestep_sampling(
            "logit_normal", batch, logit_mean=0.0, logit_std=1.0, generator=g
        ),
        "text": torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=g),  # (B, S, D)
        "pooled": torch.randn(batch, POOLED_DIM, generator=g),
    }


def flow_loss(model: Any, b: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The rectified-flow loss of ``model`` (Flux or SD3) on batch ``b``, inputs on ``device``."""
    b = {k: v.to(device) for k, v in b.items()}
    x0, noise = b["x0"], b["noise"]
    t = b["t"].view(-1, 1, 1, 1)
    xt = (1 - t) * x0 + t * noise  # (B, C, H, W)
    target = noise - x0
    batch, channels, height, width = x0.shape
    if isinstance(model, SD3Transformer2DModel):
        pred = model(
            hidden_states=xt,
            encoder_hidden_states=b["text"],
            pooled_projections=b["pooled"],
            timestep=b["t"] * 1000,  # SD3 embeds timesteps in [0, 1000)
            return_dict=False,
        )[0]
        return torch.nn.functional.mse_loss(pred.float(), target.float())
    packed = FluxPipeline._pack_latents(xt, batch, channels, height, width)  # (B, L, 4C)
    img_ids = FluxPipeline._prepare_latent_image_ids(
        batch, height // 2, width // 2, device, x0.dtype
    )
    txt_ids = torch.zeros(b["text"].shape[1], 3, device=device)
    guidance = None
    if model.config.guidance_embeds:
        guidance = torch.full((batch,), 3.5, device=device)
    pred = model(
        hidden_states=packed,
        timestep=b["t"],  # Flux scales timesteps by 1000 itself
        guidance=guidance,
        pooled_projections=b["pooled"],
        encoder_hidden_states=b["text"],
        txt_ids=txt_ids,
        img_ids=img_ids,
        return_dict=False,
    )[0]
    target = FluxPipeline._pack_latents(target, batch, channels, height, width)
    return torch.nn.functional.mse_loss(pred.float(), target.float())
