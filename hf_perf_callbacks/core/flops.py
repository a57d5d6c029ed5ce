"""FLOPs per token of a causal language model: full fine-tuning, LoRA, activation recompute, attention.

Conventions (the PaLM appendix-B accounting, which Lightning and nanoGPT use too):

* A matmul weight with ``P`` parameters costs ``2P`` FLOPs per token forward. Embedding lookups cost nothing;
  the LM head is a matmul.
* Backward costs ``2P`` for the activation gradient plus ``2P`` for the weight gradient. Frozen weights (the base
  model under LoRA) get no weight-gradient GEMM: ``4P`` per token instead of ``6P``; trainable adapters ``6P``.
* Attention scores and the weighted sum cost ``4 · layers · attention_dim · seq_len`` forward per token (no causal
  discount), and twice that backward.
* Activation recompute (gradient checkpointing) re-runs the forward once more. It is counted in *hardware* FLOPs
  (HFU) but not in *model* FLOPs (MFU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .validation import check_number


@dataclass(frozen=True)
class MatmulCount:
    """What the FLOP count needs to know about a model: its matrix-multiply weights, frozen and trained, its layers
    and attention width (read off a live model by :func:`shape_of`; the estimates' architecture is
    :class:`~hf_perf_callbacks.estimate.ModelShape`, read from a config)."""

    frozen_matmul_params: int     # matmul weights that receive no gradient (LoRA base, frozen layers)
    trainable_matmul_params: int  # matmul weights that are trained (all of them in full fine-tuning)
    num_layers: int
    attention_dim: int            # heads × head_dim of the query projection

    @property
    def matmul_params(self) -> int:
        return self.frozen_matmul_params + self.trainable_matmul_params


def attention_flops_per_token(shape: MatmulCount, seq_len: float) -> float:
    """Forward FLOPs per token of QKᵀ and the attention-weighted sum."""
    return 4.0 * shape.num_layers * shape.attention_dim * seq_len


def forward_flops_per_token(shape: MatmulCount, seq_len: float) -> float:
    """One forward pass (also a generation step) per token."""
    check_number("seq_len", seq_len, low=0)
    return 2.0 * shape.matmul_params + attention_flops_per_token(shape, seq_len)


def train_flops_per_token(shape: MatmulCount, seq_len: float, recompute: bool = False) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per trained token for forward + backward.

    Model FLOPs: ``2N + 4·frozen + 4·trainable + 3·attention`` = ``6N + 3A`` for full fine-tuning and
    ``4N + 2·trainable + 3A`` under LoRA. Hardware FLOPs add one more forward when activations are recomputed.
    """
    forward = forward_flops_per_token(shape, seq_len)
    attention = attention_flops_per_token(shape, seq_len)
    backward = 2.0 * shape.matmul_params + 2.0 * shape.trainable_matmul_params + 2.0 * attention
    model = forward + backward
    return model, model + (forward if recompute else 0.0)


def full_numel(tensor: Any) -> int:
    """A parameter's elements in the whole model: DeepSpeed ZeRO-3 leaves each rank's parameter empty (its partition
    lives elsewhere) and records the full count as ``ds_numel``; an FSDP2 DTensor's ``numel()`` is already the full
    tensor's."""
    full = getattr(tensor, "ds_numel", None)
    return int(full) if isinstance(full, int) else int(tensor.numel())


def shape_of(model: Any) -> MatmulCount:
    """Read a ``MatmulCount`` off a torch model (a PEFT model works: LoRA layers are ``nn.Linear``).

    Matmul parameters are the weights of ``nn.Linear`` modules (and GPT-2 style ``Conv1D``); they are frozen or
    trainable by ``requires_grad``. Layers and attention width come from the model config.
    """
    import torch

    frozen = trainable = 0
    for module in model.modules():
        is_matmul = isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        weight = getattr(module, "weight", None)
        if is_matmul and isinstance(weight, torch.Tensor):
            if weight.requires_grad:
                trainable += full_numel(weight)
            else:
                frozen += full_numel(weight)
    config = text_config(model)
    layers = int(_first(config, "num_hidden_layers", "n_layer", "num_layers", default=0))
    heads = int(_first(config, "num_attention_heads", "n_head", default=0))
    hidden = int(_first(config, "hidden_size", "n_embd", "d_model", default=0))
    head_dim = _first(config, "head_dim", default=None) or (hidden // heads if heads else 0)
    return MatmulCount(frozen, trainable, layers, int(heads * head_dim))


def text_config(model: Any) -> Any:
    """The model's (text) config, or None: duck-typed, no transformers import."""
    config = getattr(model, "config", None)
    if config is None and hasattr(model, "get_base_model"):
        config = getattr(model.get_base_model(), "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return config


def _first(config: object, *names: str, default: int | None) -> Any:
    """The first of the config attributes ``names`` that is set (an untyped config value), else ``default``."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default
