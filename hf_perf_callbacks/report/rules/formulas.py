"""Memory estimates written out with their formulas: the run header's model config and the memory model of
:mod:`hf_perf_callbacks.estimate` (the one behind the recipes' memory table), per token (KV cache, activations,
the LM head's logits).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ... import estimate
from ..model import Measurements
from .advice import _gb, _generation_batch


def _dims(model: dict[str, Any]) -> dict[str, Any] | None:
    """The run header's model facts as :mod:`~hf_perf_callbacks.estimate`'s model dict plus ``bytes`` (bytes per
    parameter, default 2); None when layers, hidden size or attention heads are unknown."""
    if not (model.get("num_hidden_layers") and model.get("hidden_size") and model.get("num_attention_heads")):
        return None
    return {**estimate.model_from_config(model), "bytes": model.get("bytes_per_param") or 2}


def _known(compute: Callable[..., int], *args: Any) -> int | None:
    """``compute(*args)``, or None when the model facts it needs are missing from the run header."""
    try:
        return compute(*args)
    except ValueError:
        return None


def _kv_per_token(model: dict[str, Any]) -> int | None:
    d = _dims(model)
    return _known(estimate.kv_cache_bytes_per_token, d, d["bytes"]) if d else None


def _act_per_token(model: dict[str, Any], checkpointing: bool) -> int | None:
    d = _dims(model)
    return _known(estimate.activation_bytes_per_token, d, d["bytes"], checkpointing) if d else None


def _logits_per_token(model: dict[str, Any]) -> int:
    d = _dims(model)
    return (_known(estimate.logits_bytes_per_token, d) or 0) if d else 0


def _known_dims(model: dict[str, Any]) -> dict[str, Any]:
    """:func:`_dims` of a model whose per-token bytes were computed: the formulas are written only then."""
    d = _dims(model)
    assert d is not None, "a formula of a model without layers, hidden size or attention heads"
    return d


def _kv_formula(model: dict[str, Any]) -> str:
    d = _known_dims(model)
    return f"2 × {d['layers']} layers × {d['kv_heads']} kv_heads × {d['head_dim']} head_dim × {d['bytes']} B"


def _act_formula(model: dict[str, Any], checkpointing: bool) -> str:
    """The activation bytes per token as :func:`estimate.activation_bytes_per_token` computes them, written with
    this model's numbers (each number followed by its name: the text evaluates to the bytes)."""
    d = _known_dims(model)
    b = d["bytes"]
    if checkpointing:
        return f"{d['layers']} layers × {d['hidden']} hidden × {b} B"
    lora = estimate.layer_activation_bytes(d, b, 1) - estimate.layer_activation_bytes(d, b, 0)   # Σ LoRA inputs
    return (f"{d['layers']} layers × (2 × {estimate.NORM_BYTES} × {d['hidden']} hidden + {b} × (4 × "
            f"{d['heads'] * d['head_dim']} q_dim + 3 × {d['intermediate']} intermediate) + 4 × {lora} lora_inputs) B")


def _train_formula(model: dict[str, Any], checkpointing: bool) -> str:
    """Activations plus the LM head's tile per training token (:func:`estimate.logits_bytes_per_token`), as text."""
    d = _known_dims(model)
    if not _logits_per_token(model):
        return _act_formula(model, checkpointing)
    head = (f"({estimate.HEAD_VOCAB_CHUNK} vocab_chunk × 2 + {min(d['vocab'], estimate.HEAD_VOCAB_CHUNK)} "
            f"tile_columns × {estimate.HEAD_TILE_TEMP_BYTES['torch']} + {d['hidden']} hidden × (2 + 4)) B lm_head")
    return f"{_act_formula(model, checkpointing)} + {head}"


def _training_tokens(m: Measurements) -> tuple[int, str] | None:
    """Tokens of one training micro-batch (micro-batch × padded length) for activation estimates."""
    if not m.micro_batch:
        return None
    if m.seq_len:
        return m.micro_batch * m.seq_len, f"{m.micro_batch} × {m.seq_len} tokens"
    return None


def _memory_freed_by_cut(m: Measurements, old: int, new: int) -> tuple[float, str] | None:
    """Memory a completion cap of ``new`` instead of ``old`` frees at the cap: generation KV cache + training
    activations and logits (:mod:`~hf_perf_callbacks.estimate`'s per-token bytes × the tokens cut)."""
    kv = _kv_per_token(m.model)
    batch = _generation_batch(m)                 # completions per generation call, over all devices
    n = batch // max(1, m.world_size or 1) if batch else m.num_generations
    if kv is None or not n:
        return None
    cut = old - new
    kv_total = kv * cut * n
    parts = [f"KV cache = {_kv_formula(m.model)} × ({old} − {new}) tokens × {n} sequences = {_gb(kv_total)}"]
    total = kv_total
    ckpt = bool(m.activation_checkpointing)
    act = _act_per_token(m.model, ckpt)
    if act and m.micro_batch:
        train = (act + _logits_per_token(m.model)) * cut * m.micro_batch
        total += train
        parts.append(f"training activations and logits = ({_train_formula(m.model, ckpt)}) × {cut} tokens × "
                     f"{m.micro_batch} micro-batch = {_gb(train)}")
    return total, "; ".join(parts)
