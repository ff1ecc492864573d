"""Fixtures for tests, notebooks, the demo and benchmarks: models with non-degenerate weights, and tiny
pipelines (random small text encoders, tokenizers and VAEs; nothing is downloaded).

A freshly constructed PRX is the identity: ``Modulation.lin`` is zero-initialised, so every block's
gates are 0 and attention cannot change the output. ``make_nondegenerate_`` re-initialises what the
model's spec names (``ModelSpec.nondegenerate_``); any equivalence check against eager must use it,
or it proves nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ..models import SPECS, spec_for
from ..models.flux import TINY as TINY_FLUX
from ..models.prx import PIXEL as PIXEL_PRX
from ..models.prx import TINY as TINY_PRX
from ..models.prx import TINY_PIXEL as TINY_PIXEL_PRX

#: diffusers' default PRX (1.17 B parameters): hidden 1792, 28 heads, depth 16, context 2304.
FULL_PRX: dict[str, Any] = {}

PATCHIFY_FORMS = ("reshape", "fold")

__all__ = ["TINY_PRX", "TINY_PIXEL_PRX", "PIXEL_PRX", "TINY_FLUX", "FULL_PRX"]


def make_nondegenerate_(model: torch.nn.Module, std: float = 0.02, seed: int = 0) -> torch.nn.Module:
    """Re-initialise, in place, what a fresh model of this class leaves at zero (PRX: every
    ``Modulation.lin``, weight and bias ~ N(0, std)); ``ModelSpec.nondegenerate_``."""
    return spec_for(model).nondegenerate_(model, std=std, seed=seed)


def make_model(
    name: str = "prx",
    config: dict[str, Any] | None = None,
    *,
    seed: int = 0,
    std: float = 0.02,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """A model of family ``name`` ("prx", "flux") with non-degenerate weights, in eval mode; ``config``
    defaults to the family's tiny one (``ModelSpec.tiny``)."""
    spec = SPECS[name]
    torch.manual_seed(seed)
    model = spec.model_class()(**(spec.tiny if config is None else config))
    spec.nondegenerate_(model, std=std, seed=seed)
    if dtype != torch.float32:
        model = model.to(dtype=dtype)
    return model.to(device=device).eval()


def make_flux(config: dict[str, Any] | None = None, **kwargs: Any) -> torch.nn.Module:
    """A FLUX transformer (default: the tiny one, ``TINY_FLUX``) with its constructor's random weights."""
    return make_model("flux", config, **kwargs)


def img2seq_fold(img: torch.Tensor, patch_size: int) -> torch.Tensor:
    """diffusers 0.36's img2seq: (B, C, H, W) -> (B, L, C*p*p) through ``F.unfold`` (Im2Col)."""
    return F.unfold(img, kernel_size=patch_size, stride=patch_size).transpose(1, 2)


def seq2img_fold(seq: torch.Tensor, patch_size: int, shape) -> torch.Tensor:
    """diffusers 0.36's seq2img: (B, L, C*p*p) -> (B, C, H, W) through ``F.fold`` (Col2Im)."""
    if isinstance(shape, tuple):
        shape = shape[-2:]
    elif isinstance(shape, torch.Tensor):
        shape = (int(shape[0]), int(shape[1]))
    else:
        raise NotImplementedError(f"shape type {type(shape)} not supported")
    return F.fold(seq.transpose(1, 2), shape, kernel_size=patch_size, stride=patch_size)


@contextlib.contextmanager
def fold_patchify() -> Iterator[None]:
    """Within the block, diffusers' PRX patchifies with F.unfold/F.fold exactly as diffusers 0.36 did."""
    from diffusers.models.transformers import transformer_prx as tp

    saved = tp.img2seq, tp.seq2img
    tp.img2seq, tp.seq2img = img2seq_fold, seq2img_fold
    try:
        yield
    finally:
        tp.img2seq, tp.seq2img = saved


def _fold_class():
    from diffusers import PRXTransformer2DModel

    class PRXTransformer2DModelFold(PRXTransformer2DModel):
        """PRX whose img2seq/seq2img are diffusers 0.36's F.unfold/F.fold (Im2Col/Col2Im)."""

        def forward(
            self,
            hidden_states,
            timestep,
            encoder_hidden_states,
            attention_mask=None,
            attention_kwargs=None,
            return_dict=True,
        ):
            with fold_patchify():
                return super().forward(
                    hidden_states,
                    timestep,
                    encoder_hidden_states,
                    attention_mask,
                    attention_kwargs,
                    return_dict,
                )

    return PRXTransformer2DModelFold


def make_prx(
    config: dict[str, Any] | None = None,
    *,
    patchify: str = "reshape",
    seed: int = 0,
    std: float = 0.02,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """A PRXTransformer2DModel with non-degenerate weights, in eval mode.

    Args:
        config: PRX constructor kwargs; default ``TINY_PRX``. ``FULL_PRX`` ({}) is the 1.17 B model.
        patchify: ``"reshape"`` (diffusers >= 0.37) or ``"fold"`` (diffusers 0.36's F.unfold/F.fold).
        seed, std: weights are reproducible from the seed; modulation weights ~ N(0, std).
    """
    from diffusers import PRXTransformer2DModel

    if patchify not in PATCHIFY_FORMS:
        raise ValueError(f"patchify={patchify!r} is not one of {PATCHIFY_FORMS}")
    cls = _fold_class() if patchify == "fold" else PRXTransformer2DModel
    torch.manual_seed(seed)
    model = cls(**(TINY_PRX if config is None else config))
    SPECS["prx"].nondegenerate_(model, std=std, seed=seed)
    if dtype != torch.float32:
        model = model.to(dtype=dtype)
    return model.to(device=device).eval()


#: Words the tiny tokenizer knows (anything else maps to <unk>).
_TINY_VOCAB = (
    "a photo of an astronaut riding horse on the moon cat dog red blue green sky city night "
    "painting portrait forest mountain river sunset ocean car robot castle"
).split()


def tiny_tokenizer(max_length: int = 16):
    """An in-memory word-level tokenizer (no download): <pad>=0, <eos>=1, <bos>=2, <unk>=3."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for w in _TINY_VOCAB:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<eos>",
        bos_token="<bos>",
        model_max_length=max_length,
    )


def tiny_text_encoder(vocab_size: int, hidden_size: int, seed: int = 0):
    """A one-layer T5Gemma encoder with random weights whose output width is ``hidden_size``."""
    from transformers.models.t5gemma.configuration_t5gemma import T5GemmaConfig, T5GemmaModuleConfig
    from transformers.models.t5gemma.modeling_t5gemma import T5GemmaEncoder

    params = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "max_position_embeddings": 128,
        "layer_types": ["full_attention"],
        "attention_dropout": 0.0,
        "dropout_rate": 0.0,
        "query_pre_attn_scalar": 8,
        "sliding_window": 4096,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "rope_theta": 10000.0,
    }
    torch.manual_seed(seed)
    module_config = T5GemmaModuleConfig(**params)
    try:  # transformers >= 5.2x builds the encoder from its module config
        return T5GemmaEncoder(module_config).eval()
    except (AttributeError, TypeError):  # older: from the full config, as diffusers' own tests do
        torch.manual_seed(seed)
        config = T5GemmaConfig(encoder=module_config, is_encoder_decoder=False, **params)
        return T5GemmaEncoder(config).eval()


def tiny_vae(latent_channels: int = 4, seed: int = 0, scale: int = 1):
    """A small random AutoencoderKL that maps ``scale`` pixels to one latent (1, 2, 4 or 8: one block
    per halving, 8 channels per block); the default 1x one has latents = pixels."""
    from diffusers import AutoencoderKL

    blocks = {1: 1, 2: 2, 4: 3, 8: 4}.get(scale)
    if blocks is None:
        raise ValueError(f"scale={scale!r} is not one of 1, 2, 4, 8")
    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=(8,) * blocks,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=2,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0,
        scaling_factor=1.0,
    ).eval()


def tiny_pipeline(
    transformer: torch.nn.Module | None = None,
    *,
    text_len: int = 16,
    vae: bool = True,
    vae_scale: int = 1,
    seed: int = 0,
):
    """A complete PRXPipeline with random small components (CPU-friendly, no download).

    ``transformer`` defaults to the tiny PRX; pass ``make_prx(FULL_PRX, ...)`` for the 1.17 B one (the
    text encoder then takes its 2304-wide context). The VAE, if any, is ``vae_scale``x: with the
    default 1x, ``height``/``width`` are latent sizes; with 8x, as PRX's own, 1024² images are 128²
    latents. With ``vae=False`` the pipeline returns latents (``output_type="latent"``) and assumes 8x.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, PRXPipeline

    transformer = transformer if transformer is not None else make_prx(seed=seed)
    tokenizer = tiny_tokenizer(text_len)
    encoder = tiny_text_encoder(len(tokenizer), transformer.config.context_in_dim, seed=seed)
    from .pipeline import quiet_lora_mixin

    with quiet_lora_mixin():
        return PRXPipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(),
            text_encoder=encoder,
            tokenizer=tokenizer,
            vae=tiny_vae(transformer.config.in_channels, seed, scale=vae_scale) if vae else None,
        )


def tiny_pixel_pipeline(transformer: torch.nn.Module | None = None, *, text_len: int = 16, seed: int = 0):
    """A complete PRXPixelPipeline (pixel space: no VAE) with random small components: the tiny
    PRXPixel (``TINY_PIXEL_PRX``, or ``transformer``), a one-layer random text encoder and a word-level
    tokenizer; prompts are padded to ``text_len`` tokens."""
    from diffusers import FlowMatchEulerDiscreteScheduler, PRXPixelPipeline

    transformer = transformer if transformer is not None else make_prx(TINY_PIXEL_PRX, seed=seed)
    tokenizer = tiny_tokenizer(text_len)
    encoder = tiny_text_encoder(len(tokenizer), transformer.config.context_in_dim, seed=seed)
    return PRXPixelPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=encoder,
        tokenizer=tokenizer,
        default_sample_size=1024,
        prompt_max_tokens=text_len,
    )


def tiny_flux_pipeline(
    transformer: torch.nn.Module | None = None, *, text_len: int = 8, vae_scale: int = 1, seed: int = 0
):
    """A complete FluxPipeline with random small components (CPU-friendly, no download): the tiny FLUX
    (or ``transformer``), a one-layer CLIP text encoder whose pooled output is the transformer's
    ``pooled_projection_dim`` wide, a one-layer T5 encoder of its ``joint_attention_dim``, word-level
    tokenizers, and a ``vae_scale``x VAE. Call it with ``max_sequence_length=text_len``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    transformer = transformer if transformer is not None else make_flux(seed=seed)
    cfg = transformer.config
    tokenizer, tokenizer_2 = tiny_tokenizer(text_len), tiny_tokenizer(text_len)
    torch.manual_seed(seed)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=cfg.pooled_projection_dim,
            intermediate_size=2 * cfg.pooled_projection_dim,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=max(text_len, 16),
            projection_dim=cfg.pooled_projection_dim,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        )
    ).eval()
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=cfg.joint_attention_dim,
            d_kv=8,
            d_ff=2 * cfg.joint_attention_dim,
            num_layers=1,
            num_heads=2,
        )
    ).eval()
    return FluxPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=clip,
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=tokenizer_2,
        vae=tiny_vae(cfg.in_channels // 4, seed, scale=vae_scale),
    )
