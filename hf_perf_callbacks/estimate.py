"""Back-of-the-envelope device memory for GRPO + LoRA on a decoder-only LM (Llama / Qwen2 shape). Pure math.

These are **estimates** for choosing a recipe, not measurements: allocator caches, fragmentation, MPSGraph caches,
CUDA context, temporary buffers and framework overhead come on top. Measure the real run with ``MemoryWatchdog``
(``mem/peak_gb``) and let the batch tuner pick the split.

``QWEN25`` holds the public config facts of three Qwen2.5 Instruct models, read from each model's ``config.json``
on the Hugging Face hub (``https://huggingface.co/Qwen/Qwen2.5-{0.5B,1.5B,3B}-Instruct/blob/main/config.json``).
``head_dim`` is ``hidden_size / num_attention_heads`` (the config has no such key); ``params`` is the exact
parameter count of that config with tied embeddings (``Qwen2ForCausalLM`` on the meta device), which matches the
model cards' 0.49B / 1.54B / 3.09B.
"""
from __future__ import annotations

from .validation import check_flag, check_number

#: Qwen2.5 Instruct configs (source: the models' config.json on the hub, see the module docstring).
QWEN25: dict[str, dict] = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, head_dim=64,
                                       vocab=151936, tie_word_embeddings=True, params=494_032_768),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, head_dim=128,
                                       vocab=151936, tie_word_embeddings=True, params=1_543_714_304),
    "Qwen/Qwen2.5-3B-Instruct": dict(layers=36, hidden=2048, intermediate=11008, heads=16, kv_heads=2, head_dim=128,
                                     vocab=151936, tie_word_embeddings=True, params=3_085_938_688),
}

MODEL_KEYS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "params")
#: Every linear layer of a Llama / Qwen2 block (what ``lora_target_modules: [all-linear]`` selects).
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Bytes per trainable LoRA parameter: fp32 weight (4) + fp32 gradient (4) + AdamW exp_avg and exp_avg_sq (8).
LORA_BYTES_PER_PARAM = 16
#: Bytes per logit: log-softmax runs in fp32.
LOGIT_BYTES = 4


def _check_model(model: dict, keys=MODEL_KEYS) -> None:
    """``model`` is a dict whose ``keys`` are integers >= 1 (ValueError naming the key otherwise)."""
    if not isinstance(model, dict):
        raise ValueError(f"model={model!r} is not allowed: expected a dict with keys {', '.join(keys)}")
    missing = [key for key in keys if key not in model]
    if missing:
        raise ValueError(f"model is missing {missing}: expected a dict with keys {', '.join(keys)} "
                         f"(see QWEN25 for examples)")
    for key in keys:
        check_number(f"model[{key!r}]", model[key], low=1, integer=True)


def model_from_config(config: dict) -> dict:
    """This module's model dict from a Hugging Face config's keys (``num_hidden_layers``, ``hidden_size``,
    ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``vocab_size``,
    ``params``), e.g. the ``model`` facts of a run's perf log header. ``kv_heads`` defaults to ``heads`` and
    ``head_dim`` to ``hidden / heads``; keys the config lacks are None (the functions needing them raise)."""
    layers, hidden, heads = (config.get(k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads"))
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    return dict(layers=layers, hidden=hidden, intermediate=config.get("intermediate_size"), heads=heads,
                kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
                vocab=config.get("vocab_size"), params=config.get("params"))


def _linear_shapes(model: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer in one block."""
    h, i = model["hidden"], model["intermediate"]
    q, kv = model["heads"] * model["head_dim"], model["kv_heads"] * model["head_dim"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def lora_param_count(model: dict, r: int, target_modules=ALL_LINEAR) -> int:
    """Trainable LoRA parameters: ``layers × Σ r × (in + out)`` over the targeted linear layers of each block."""
    _check_model(model)
    check_number("r", r, low=1, integer=True)
    shapes = _linear_shapes(model)
    unknown = [name for name in target_modules if name not in shapes]
    if unknown:
        raise ValueError(f"target_modules={list(target_modules)!r} is not allowed: {unknown} unknown; "
                         f"allowed are {list(shapes)}")
    return model["layers"] * sum(r * (shapes[name][0] + shapes[name][1]) for name in target_modules)


def layer_activation_elements(model: dict) -> int:
    """Elements autograd keeps per token for one Llama / Qwen2 block (an estimate):
    ``6·hidden + 2·kv_heads·head_dim + 4·intermediate``.

    Counted from what backward needs, with fused SDPA attention (no seq × seq score matrix is kept) and no
    dropout: the two RMSNorm inputs and outputs (4·hidden), q (hidden) and k, v (2·kv_heads·head_dim) for
    attention, the attention output entering ``o_proj`` (hidden), and for the SwiGLU MLP the gate and up
    outputs, SiLU(gate) and their product entering ``down_proj`` (4·intermediate). LoRA's rank-r intermediates
    are negligible. For Qwen2.5 this is ≈ 28–30 × hidden per token (Korthikanti et al. 2022 count 34·hidden
    *bytes* for a GPT block with a 4·hidden MLP, dropout masks and materialised attention scores).
    """
    _check_model(model, ("hidden", "intermediate", "kv_heads", "head_dim"))
    return 6 * model["hidden"] + 2 * model["kv_heads"] * model["head_dim"] + 4 * model["intermediate"]


def kv_cache_bytes_per_token(model: dict, dtype_bytes: int) -> int:
    """Keys and values of one token over all layers: ``2 × layers × kv_heads × head_dim × dtype_bytes``."""
    _check_model(model, ("layers", "kv_heads", "head_dim"))
    check_number("dtype_bytes", dtype_bytes, low=1, integer=True)
    return 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * dtype_bytes


def activation_bytes_per_token(model: dict, dtype_bytes: int, activation_checkpointing: bool) -> int:
    """Activations autograd keeps per training token: with checkpointing ``(layers × hidden +
    layer_activation_elements) × dtype_bytes`` (one saved input per block plus the block being recomputed), without
    ``layers × layer_activation_elements × dtype_bytes``."""
    _check_model(model, ("layers",))
    check_number("dtype_bytes", dtype_bytes, low=1, integer=True)
    check_flag("activation_checkpointing", activation_checkpointing)
    per_layer = layer_activation_elements(model)
    if activation_checkpointing:
        return (model["layers"] * model["hidden"] + per_layer) * dtype_bytes
    return model["layers"] * per_layer * dtype_bytes


def logits_bytes_per_token(model: dict) -> int:
    """Full-vocabulary logits of one training token: ``vocab × LOGIT_BYTES`` (fp32 log-softmax)."""
    _check_model(model, ("vocab",))
    return model["vocab"] * LOGIT_BYTES


def estimate_grpo_memory(model: dict, *, micro_batch: int, num_generations: int, generation_batch: int,
                         prompt_tokens: int, max_completion_length: int, dtype_bytes: int, lora_params: int,
                         activation_checkpointing: bool) -> dict[str, float]:
    """Estimated bytes on one device for GRPO + LoRA, by part (all values are estimates, see the module docstring).

    Let ``seq = prompt_tokens + max_completion_length`` (every completion at its maximum: the worst case) and
    ``tokens = micro_batch × seq``.

    - ``weights`` = ``params × dtype_bytes`` (the frozen base model; ``beta: 0`` means no reference copy).
    - ``lora`` = ``lora_params × 16``: fp32 weights, fp32 gradients and the two fp32 AdamW moments.
    - ``kv_cache`` = ``2 × layers × kv_heads × head_dim × dtype_bytes × seq × generation_batch``: keys and values
      for every sequence decoded at once (``generation_batch`` = completions generated together on this device,
      a multiple of ``num_generations``).
    - ``activations`` (one training micro-batch): with checkpointing
      ``layers × hidden × tokens × dtype_bytes`` (one saved input per block) plus one block's full activations,
      ``layer_activation_elements × tokens × dtype_bytes`` (the block being recomputed); without checkpointing
      ``layers × layer_activation_elements × tokens × dtype_bytes``.
    - ``logits`` = ``micro_batch × seq × vocab × 4`` (fp32 log-softmax over the whole vocabulary). TRL 1.16's fused
      LM head computes log-probs in tiles, so this is the upper bound of the unfused path.
    - ``total`` = the sum. Generation (KV cache) and training (activations, logits) do not overlap in time, but a
      caching allocator keeps freed blocks, so the sum is what the device can end up holding between cache clears.
    """
    _check_model(model)
    for name, value in (("micro_batch", micro_batch), ("num_generations", num_generations),
                        ("generation_batch", generation_batch), ("max_completion_length", max_completion_length),
                        ("dtype_bytes", dtype_bytes)):
        check_number(name, value, low=1, integer=True)
    check_number("prompt_tokens", prompt_tokens, low=0, integer=True)
    check_number("lora_params", lora_params, low=0, integer=True)
    if num_generations < 2:
        raise ValueError(f"num_generations={num_generations} is not allowed: GRPO needs at least 2")
    if generation_batch % num_generations:
        raise ValueError(f"generation_batch={generation_batch} is not allowed: it must be a multiple of "
                         f"num_generations={num_generations} (whole prompt groups)")
    check_flag("activation_checkpointing", activation_checkpointing)

    seq = prompt_tokens + max_completion_length
    tokens = micro_batch * seq
    parts = {
        "weights": model["params"] * dtype_bytes,
        "lora": lora_params * LORA_BYTES_PER_PARAM,
        "kv_cache": kv_cache_bytes_per_token(model, dtype_bytes) * seq * generation_batch,
        "activations": activation_bytes_per_token(model, dtype_bytes, activation_checkpointing) * tokens,
        "logits": logits_bytes_per_token(model) * tokens,
    }
    parts = {key: float(value) for key, value in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def format_gib(value: float) -> str:
    """Bytes as GiB (1024³, the unit of ``MemoryWatchdog``'s ``limit_gb``) with two decimals."""
    return f"{value / 1024**3:.2f}"
