"""Memory estimates written out with their formulas: the run header's model config and the memory model of
:mod:`hf_perf_callbacks.estimate` (the one behind the recipes' memory table), per token (KV cache, activations,
the LM head's logits).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ... import estimate
from ...estimate import ModelShape
from ..facts import MemoryFreed
from ..model import Measurements, ModelFacts
from .advice import _generation_batch


def _known(compute: Callable[..., int], *args: Any) -> int | None:
    """``compute(*args)``, or None when the model facts it needs are missing from the run header."""
    try:
        return compute(*args)
    except ValueError:
        return None


def _act_per_token(model: ModelFacts, checkpointing: bool) -> int | None:
    d = model.shape
    return _known(estimate.activation_bytes_per_token, d, model.bytes_per_param, checkpointing) if d else None


def _logits_per_token(model: ModelFacts) -> int:
    d = model.shape
    return (_known(estimate.logits_bytes_per_token, d) or 0) if d else 0


def _known_shape(model: ModelFacts) -> ModelShape:
    """The shape of a model whose per-token bytes were computed: the formulas are written only then."""
    assert model.shape is not None, "a formula of a model without layers, hidden size or attention heads"
    return model.shape


def _kv_formula(model: ModelFacts) -> str:
    d = _known_shape(model)
    return f"2 × {d.layers} layers × {d.kv_heads} kv_heads × {d.head_dim} head_dim × {model.bytes_per_param} B"


def _act_formula(model: ModelFacts, checkpointing: bool) -> str:
    """The activation bytes per token as :func:`estimate.activation_bytes_per_token` computes them, written with
    this model's numbers (each number followed by its name: the text evaluates to the bytes)."""
    d, b = _known_shape(model), model.bytes_per_param
    if checkpointing:
        return f"{d.layers} layers × {d.hidden} hidden × {b} B"
    lora = estimate.layer_activation_bytes(d, b, 1) - estimate.layer_activation_bytes(d, b, 0)   # Σ LoRA inputs
    heads, head_dim = d.ints("heads", "head_dim")
    return (f"{d.layers} layers × (2 × {estimate.NORM_BYTES} × {d.hidden} hidden + {b} × (4 × "
            f"{heads * head_dim} q_dim + 3 × {d.intermediate} intermediate) + 4 × {lora} lora_inputs) B")


def _train_formula(model: ModelFacts, checkpointing: bool) -> str:
    """Activations plus the LM head's tile per training token (:func:`estimate.logits_bytes_per_token`), as text."""
    d = _known_shape(model)
    if not _logits_per_token(model):
        return _act_formula(model, checkpointing)
    (vocab,) = d.ints("vocab")
    head = (f"({estimate.HEAD_VOCAB_CHUNK} vocab_chunk × 2 + {min(vocab, estimate.HEAD_VOCAB_CHUNK)} "
            f"tile_columns × {estimate.HEAD_TILE_TEMP_BYTES['torch']} + {d.hidden} hidden × (2 + 4)) B lm_head")
    return f"{_act_formula(model, checkpointing)} + {head}"


def _training_tokens(m: Measurements) -> tuple[int, str] | None:
    """Tokens of one training micro-batch (micro-batch × padded length) for activation estimates."""
    if not (m.micro_batch and m.seq_len):
        return None
    return m.micro_batch * m.seq_len, f"{m.micro_batch} × {m.seq_len} tokens"


def _memory_freed_by_cut(m: Measurements, old: int, new: int) -> MemoryFreed | None:
    """Memory a completion cap of ``new`` instead of ``old`` frees at the cap: generation KV cache + training
    activations and logits (:mod:`~hf_perf_callbacks.estimate`'s per-token bytes × the tokens cut)."""
    d = m.model.shape
    kv = _known(estimate.kv_cache_bytes_per_token, d, m.model.bytes_per_param) if d else None
    batch = _generation_batch(m)                 # completions per generation call, over all devices
    n = batch // max(1, m.world_size or 1) if batch else m.num_generations
    if kv is None or not n:
        return None
    cut = old - new
    kv_total = float(kv * cut * n)
    ckpt = bool(m.activation_checkpointing)
    act = _act_per_token(m.model, ckpt)
    if not (act and m.micro_batch):
        return MemoryFreed(kv_total, kv_total, _kv_formula(m.model), old, new, n)
    train = float((act + _logits_per_token(m.model)) * cut * m.micro_batch)
    return MemoryFreed(kv_total + train, kv_total, _kv_formula(m.model), old, new, n, train,
                       _train_formula(m.model, ckpt), m.micro_batch)
