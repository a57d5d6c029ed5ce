"""Back-of-the-envelope device memory for GRPO + LoRA on a decoder-only LM (Llama / Qwen2 shape). Pure math.

These are **estimates** for choosing a recipe, not measurements: allocator caches, fragmentation, MPSGraph caches,
CUDA context, temporary buffers and framework overhead come on top. Measure the real run with ``MemoryWatchdog``
(``mem/peak_gb``) and let the batch tuner pick the split.

``QWEN25`` holds the public config facts of four Qwen2.5 Instruct models, read from each model's ``config.json``
on the Hugging Face hub (``https://huggingface.co/Qwen/Qwen2.5-{0.5B,1.5B,3B,7B}-Instruct/blob/main/config.json``).
``head_dim`` is ``hidden_size / num_attention_heads`` (the config has no such key); ``params`` is the exact
parameter count of that config (``Qwen2ForCausalLM`` on the meta device; the 7B does not tie its embeddings),
which matches the model cards' 0.49B / 1.54B / 3.09B / 7.62B.

The memory model follows what TRL 1.16's ``GRPOTrainer`` holds (see :func:`estimate_grpo_memory`): one
``generate`` call for the generation batch (KV cache), then per micro-batch a forward/backward whose per-token
log-probs come from TRL's chunked LM head (``trl/kernels/chunked_logprob.py``: tiles, never the full logits).

**Sharding** (``shards``): FSDP (and DeepSpeed ZeRO-3) keeps 1/``shards`` of every parameter, gradient and
optimizer state on each rank and all-gathers one wrapped unit (a decoder layer, the embedding, the LM head) at a
time for compute; activations, KV cache and logits are per rank as without sharding.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .core.validation import check_flag, check_number

MODEL_KEYS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "params")


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only LM that the estimates read: ``layers``, ``hidden`` (size), ``intermediate`` (MLP
    size), ``heads`` and ``kv_heads`` (attention), ``head_dim``, ``vocab`` (size), ``params`` (the parameter count)
    and whether the embedding and the LM head share their weights. A field a config lacks is None; a function
    that needs it raises a ValueError naming it."""

    layers: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    vocab: int | None = None
    params: int | None = None
    tie_word_embeddings: bool = True

    @classmethod
    def of(cls, model: ModelShape | Mapping[str, Any]) -> ModelShape:
        """``model`` as a ModelShape: itself, or a mapping of its fields (as the recipes' README shows; other keys
        are left out). ValueError when it is neither."""
        if isinstance(model, ModelShape):
            return model
        if not isinstance(model, Mapping):
            raise ValueError(f"model={model!r} is not allowed: expected a ModelShape or a dict with keys "
                             f"{', '.join(MODEL_KEYS)}")
        return cls(**{f.name: model[f.name] for f in dataclasses.fields(cls) if model.get(f.name) is not None})

    def keys(self) -> list[str]:
        """Its field names: a ModelShape also reads as the mapping of its fields (``shape["layers"]``,
        ``{**shape}``), as the model dicts it replaces did."""
        return [f.name for f in dataclasses.fields(self)]

    def __getitem__(self, name: str) -> Any:
        if name not in self.keys():
            raise KeyError(name)
        return getattr(self, name)

    def ints(self, *names: str) -> tuple[int, ...]:
        """The fields ``names``, each checked to be an integer >= 1 (ValueError naming the missing or bad one)."""
        missing = [name for name in names if getattr(self, name) is None]
        if missing:
            raise ValueError(f"model is missing {missing}: expected {', '.join(names)} (see QWEN25 for examples)")
        for name in names:
            check_number(f"model[{name!r}]", getattr(self, name), low=1, integer=True)
        return tuple(int(getattr(self, name)) for name in names)


#: a ModelShape, or a mapping of its fields
ModelLike = ModelShape | Mapping[str, Any]

#: Qwen2.5 Instruct configs (source: the models' config.json on the hub, see the module docstring).
QWEN25: dict[str, ModelShape] = {
    "Qwen/Qwen2.5-0.5B-Instruct": ModelShape(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2,
                                             head_dim=64, vocab=151936, tie_word_embeddings=True, params=494_032_768),
    "Qwen/Qwen2.5-1.5B-Instruct": ModelShape(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2,
                                             head_dim=128, vocab=151936, tie_word_embeddings=True,
                                             params=1_543_714_304),
    "Qwen/Qwen2.5-3B-Instruct": ModelShape(layers=36, hidden=2048, intermediate=11008, heads=16, kv_heads=2,
                                           head_dim=128, vocab=151936, tie_word_embeddings=True, params=3_085_938_688),
    # untied embeddings (embedding and LM head are separate matrices of vocab × hidden each)
    "Qwen/Qwen2.5-7B-Instruct": ModelShape(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4,
                                           head_dim=128, vocab=152064, tie_word_embeddings=False,
                                           params=7_615_616_512),
}
#: Every linear layer of a Llama / Qwen2 block (what ``lora_target_modules: [all-linear]`` selects).
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Bytes per trainable LoRA parameter: fp32 weight (4) + fp32 gradient (4) + AdamW exp_avg and exp_avg_sq (8).
LORA_BYTES_PER_PARAM = 16
#: Bytes per parameter of a full fine-tune: fp32 master weight (4) + fp32 gradient (4) + AdamW moments (8). FSDP2
#: under bf16 mixed precision keeps the trainable parameters in fp32 (accelerate upcasts them) and computes in bf16.
FULL_BYTES_PER_PARAM = 16
#: Bytes per element RMSNorm keeps (it computes in fp32).
NORM_BYTES = 4
#: TRL 1.16's chunked log-prob head: token rows per tile (``trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE``) and
#: vocabulary columns per tile (``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``).
HEAD_TOKEN_CHUNK = 4096
HEAD_VOCAB_CHUNK = 32768
#: Bytes per tile element beyond the tile itself: the Triton kernels fold the tile in place (0); the torch path
#: (MPS, CPU) holds fp32 temporaries in its backward — 35 B per element in all with a bf16 tile, measured with
#: ``torch.profiler``'s memory timeline on TRL's ``ChunkedLogProbFunction`` (``tests/test_estimate.py``).
HEAD_TILE_TEMP_BYTES = {"triton": 0, "torch": 33}


def model_from_config(config: Mapping[str, Any]) -> ModelShape:
    """The :class:`ModelShape` of a Hugging Face config's keys (``num_hidden_layers``, ``hidden_size``,
    ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``vocab_size``,
    ``params``, ``tie_word_embeddings``), e.g. the ``model`` facts of a run's perf log header. ``kv_heads`` defaults
    to ``heads`` and ``head_dim`` to ``hidden / heads``; keys the config lacks are None (the functions needing them
    raise)."""
    layers, hidden, heads = (config.get(k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads"))
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    return ModelShape(layers=layers, hidden=hidden, intermediate=config.get("intermediate_size"), heads=heads,
                      kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
                      vocab=config.get("vocab_size"), params=config.get("params"),
                      tie_word_embeddings=bool(config.get("tie_word_embeddings", True)))


def _linear_shapes(model: ModelShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer in one block."""
    h, i, heads, kv_heads, head_dim = model.ints("hidden", "intermediate", "heads", "kv_heads", "head_dim")
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _targeted(model: ModelShape, targets: Sequence[str], name: str) -> list[tuple[int, int]]:
    """(in_features, out_features) of the targeted linear layers of one block; a ValueError names an unknown one."""
    shapes = _linear_shapes(model)
    unknown = [target for target in targets if target not in shapes]
    if unknown:
        raise ValueError(f"{name}={list(targets)!r} is not allowed: {unknown} unknown; allowed are {list(shapes)}")
    return [shapes[target] for target in targets]


def lora_param_count(model: ModelLike, r: int, target_modules: Sequence[str] = ALL_LINEAR) -> int:
    """Trainable LoRA parameters: ``layers × Σ r × (in + out)`` over the targeted linear layers of each block."""
    shape = ModelShape.of(model)
    (layers,) = shape.ints("layers")
    check_number("r", r, low=1, integer=True)
    return layers * sum(r * (i + o) for i, o in _targeted(shape, target_modules, "target_modules"))


def layer_activation_bytes(model: ModelLike, dtype_bytes: int, lora_input_bytes: int = 4,
                           lora_targets: Sequence[str] = ALL_LINEAR) -> int:
    """Bytes autograd keeps per token for one Qwen2 / Llama block with LoRA on a frozen base:
    ``2·4·hidden + dtype_bytes·(4·q_dim + 3·intermediate) + lora_input_bytes·Σ in_features(targets)``.

    - each RMSNorm computes in fp32 and keeps its fp32 input: ``2 × 4·hidden``;
    - attention keeps the rotated q, k and v expanded to all query heads (``repeat_kv``) and its output:
      ``4·q_dim`` elements (``q_dim = heads·head_dim``); fused SDPA keeps no seq × seq scores;
    - the SwiGLU MLP keeps the gate output, SiLU(gate) and the up output: ``3·intermediate``;
    - the frozen base layers keep nothing for their (absent) weight gradients, but PEFT casts each targeted
      layer's input to the adapter's dtype (fp32 by default) and ``lora_A`` keeps that copy:
      ``lora_input_bytes`` (4 without autocast, as in the Mac recipes; 2 under bf16 autocast; 0 without LoRA)
      × the input features of every targeted layer (q, k, v, gate, up: hidden; o: q_dim; down: intermediate).

    Checked against ``torch.profiler``'s memory timeline of a real Qwen2 + PEFT LoRA forward/backward on CPU
    (``tests/test_estimate.py``): the per-layer slope matches to within 1 %.
    """
    shape = ModelShape.of(model)
    h, i, heads, head_dim = shape.ints("hidden", "intermediate", "heads", "head_dim")
    check_number("dtype_bytes", dtype_bytes, low=1, integer=True)
    check_number("lora_input_bytes", lora_input_bytes, low=0, integer=True)
    q = heads * head_dim
    lora_inputs = sum(fan_in for fan_in, _ in _targeted(shape, lora_targets, "lora_targets"))
    return 2 * NORM_BYTES * h + dtype_bytes * (4 * q + 3 * i) + lora_input_bytes * lora_inputs


def backward_work_bytes(model: ModelLike, dtype_bytes: int) -> int:
    """Gradient buffers alive while one block's backward runs, per token: ``dtype_bytes·(3·intermediate +
    4·hidden)`` (the MLP's three intermediate-sized gradients and a few hidden-sized ones)."""
    hidden, intermediate = ModelShape.of(model).ints("hidden", "intermediate")
    return dtype_bytes * (3 * intermediate + 4 * hidden)


def kv_cache_bytes_per_token(model: ModelLike, dtype_bytes: int) -> int:
    """Keys and values of one token over all layers: ``2 × layers × kv_heads × head_dim × dtype_bytes``."""
    layers, kv_heads, head_dim = ModelShape.of(model).ints("layers", "kv_heads", "head_dim")
    check_number("dtype_bytes", dtype_bytes, low=1, integer=True)
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def activation_bytes_per_token(model: ModelLike, dtype_bytes: int, activation_checkpointing: bool, *,
                               lora_input_bytes: int = 4, lora_targets: Sequence[str] = ALL_LINEAR) -> int:
    """Activations autograd keeps per training token while the forward is done: without checkpointing
    ``layers × layer_activation_bytes``; with it ``layers × hidden × dtype_bytes`` (one saved input per block; the
    block being recomputed in backward is counted by :func:`estimate_grpo_memory`, which compares it with the
    LM head's working set: the two never overlap)."""
    shape = ModelShape.of(model)
    layers, hidden = shape.ints("layers", "hidden")
    check_flag("activation_checkpointing", activation_checkpointing)
    if activation_checkpointing:
        check_number("dtype_bytes", dtype_bytes, low=1, integer=True)
        return layers * hidden * dtype_bytes
    return layers * layer_activation_bytes(shape, dtype_bytes, lora_input_bytes, lora_targets)


def logits_bytes_per_token(model: ModelLike, dtype_bytes: int = 2, lm_head: str = "torch") -> int:
    """What TRL's chunked log-prob head holds per scored token, below ``HEAD_TOKEN_CHUNK`` tokens: its tile buffer,
    always ``HEAD_VOCAB_CHUNK`` columns wide (``HEAD_VOCAB_CHUNK × dtype_bytes``), the temporaries of one tile
    (``min(vocab, HEAD_VOCAB_CHUNK) × HEAD_TILE_TEMP_BYTES[lm_head]``) — never the whole vocabulary — and the hidden
    state it keeps with its fp32 gradient, ``hidden × (dtype_bytes + 4)``."""
    vocab, hidden = ModelShape.of(model).ints("vocab", "hidden")
    check_number("dtype_bytes", dtype_bytes, low=1, integer=True)
    if lm_head not in HEAD_TILE_TEMP_BYTES:
        raise ValueError(f"lm_head={lm_head!r} is not allowed: use one of {sorted(HEAD_TILE_TEMP_BYTES)} "
                         f"('triton' on CUDA/XPU with Triton, 'torch' on MPS and CPU)")
    tile = HEAD_VOCAB_CHUNK * dtype_bytes + min(vocab, HEAD_VOCAB_CHUNK) * HEAD_TILE_TEMP_BYTES[lm_head]
    return tile + hidden * (dtype_bytes + 4)


def lm_head_bytes(model: ModelLike, scored_tokens: int, dtype_bytes: int = 2, lm_head: str = "torch") -> int:
    """TRL's chunked log-prob head for ``scored_tokens``: the tile rows stop at ``HEAD_TOKEN_CHUNK`` tokens."""
    check_number("scored_tokens", scored_tokens, low=0, integer=True)
    per_token = logits_bytes_per_token(model, dtype_bytes, lm_head)
    kept = ModelShape.of(model).ints("hidden")[0] * (dtype_bytes + 4)      # the hidden state and its fp32 gradient
    return min(scored_tokens, HEAD_TOKEN_CHUNK) * (per_token - kept) + scored_tokens * kept


def estimate_grpo_memory(model: ModelLike, *, micro_batch: int, num_generations: int, generation_batch: int,
                         prompt_tokens: int, max_completion_length: int, dtype_bytes: int, lora_params: int,
                         activation_checkpointing: bool, lm_head: str = "torch", lora_input_bytes: int = 4,
                         lora_targets: Sequence[str] = ALL_LINEAR, shards: int = 1,
                         full_finetune: bool = False) -> dict[str, float]:
    """Estimated bytes on one device for GRPO (+ LoRA, or a full fine-tune) in TRL 1.16, by part: the allocator's
    live-tensor peak (what ``torch.cuda.max_memory_allocated`` reports). All values are estimates, see the module
    docstring.

    Let ``seq = prompt_tokens + max_completion_length`` (every completion at its maximum: the worst case) and
    ``tokens = micro_batch × seq``. Held the whole time:

    - ``weights`` = ``params × dtype_bytes / shards`` (the frozen base model; ``beta: 0`` means no reference copy);
      with ``full_finetune`` every parameter trains: ``params × 16 / shards`` (fp32 weights, fp32 gradients, the
      two fp32 AdamW moments) and ``lora_params`` must be 0.
    - ``lora`` = ``lora_params × 16 / shards``: fp32 weights, fp32 gradients and the two fp32 AdamW moments.
    - ``gathered`` (only when ``shards`` > 1) = ``2 × largest unit × dtype_bytes``: FSDP all-gathers the unit being
      computed and prefetches the next; the largest unit is the embedding or LM head (``vocab × hidden``) or one
      decoder layer (:func:`layer_param_count`).

    Generation (one ``generate`` call for the whole generation batch):

    - ``kv_cache`` = ``2 × layers × kv_heads × head_dim × dtype_bytes × seq × generation_batch``;
    - ``prefill`` = ``generation_batch × prompt_tokens × intermediate × (3 × dtype_bytes + lora_input_bytes)``
      (the MLP's intermediates of the prompt pass) plus ``generation_batch × vocab × (dtype_bytes + 8)`` (one
      step's logits and their fp32 copies).

    Training one micro-batch:

    - ``activations`` = :func:`activation_bytes_per_token` × ``tokens``;
    - ``logits`` = :func:`lm_head_bytes`: TRL's fused head never holds the ``tokens × vocab`` logits, only
      ``HEAD_VOCAB_CHUNK``-wide tiles of at most ``HEAD_TOKEN_CHUNK`` rows. ``lm_head="triton"`` (CUDA/XPU with
      Triton) scores only the completion tokens and folds each tile in place; ``"torch"`` (MPS, CPU) scores every
      position and holds fp32 temporaries of each tile (``HEAD_TILE_TEMP_BYTES``);
    - with checkpointing ``recompute`` = (:func:`layer_activation_bytes` + :func:`backward_work_bytes`) ×
      ``tokens``: the one block rebuilt during backward; without checkpointing ``recompute`` is only the
      backward work of one block. The head's backward runs (and frees its tiles) before any block's, so
      ``training`` = ``activations + max(logits, recompute)``. On CPU (the head's torch path) this matches
      ``torch.profiler``'s peak of a real Qwen2 + LoRA forward/backward within 1 % with checkpointing and 4 %
      without.

    - ``generation`` and ``training`` are the two phases; ``peak`` = ``weights + lora + gathered + max(generation,
      training)``: the phases do not overlap in time, and a live-tensor peak does not count freed blocks. Cached
      blocks come on top on a caching allocator (CUDA reserved, MPS driver memory): see the recipes' README.md.
    - ``total`` = ``weights + lora + gathered + kv_cache + activations + logits``: the held parts plus the
      generation's KV cache and the training's activations and logits as if all were held at once (``prefill`` and
      ``recompute`` left out), kept for comparing a change part by part; it is not a peak — a fit check reads
      ``peak``.
    """
    shape = ModelShape.of(model)
    _, hidden, intermediate, _, _, _, vocab, params = shape.ints(*MODEL_KEYS)
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
    check_number("shards", shards, low=1, integer=True)
    check_flag("full_finetune", full_finetune)
    if full_finetune and lora_params:
        raise ValueError(f"lora_params={lora_params} is not allowed with full_finetune=True: a full fine-tune trains "
                         f"every parameter and has no adapters (pass lora_params=0)")

    seq = prompt_tokens + max_completion_length
    tokens = micro_batch * seq
    scored = micro_batch * (max_completion_length if lm_head == "triton" else seq)
    block = layer_activation_bytes(shape, dtype_bytes, lora_input_bytes, lora_targets)
    work = backward_work_bytes(shape, dtype_bytes)
    parts = {
        "weights": params * (FULL_BYTES_PER_PARAM if full_finetune else dtype_bytes) / shards,
        "lora": lora_params * LORA_BYTES_PER_PARAM / shards,
        "kv_cache": kv_cache_bytes_per_token(shape, dtype_bytes) * seq * generation_batch,
        "prefill": generation_batch * (prompt_tokens * intermediate * (3 * dtype_bytes + lora_input_bytes)
                                       + vocab * (dtype_bytes + 8)),
        "activations": activation_bytes_per_token(shape, dtype_bytes, activation_checkpointing,
                                                  lora_input_bytes=lora_input_bytes,
                                                  lora_targets=lora_targets) * tokens,
        "logits": lm_head_bytes(shape, scored, dtype_bytes, lm_head),
        "recompute": (block + work) * tokens if activation_checkpointing else work * tokens,
    }
    if shards > 1:
        parts["gathered"] = 2 * max(vocab * hidden, layer_param_count(shape)) * dtype_bytes
    parts = {key: float(value) for key, value in parts.items()}
    parts["generation"] = parts["kv_cache"] + parts["prefill"]
    parts["training"] = parts["activations"] + max(parts["logits"], parts["recompute"])
    held = parts["weights"] + parts["lora"] + parts.get("gathered", 0.0)
    parts["peak"] = held + max(parts["generation"], parts["training"])
    parts["total"] = held + sum(parts[k] for k in ("kv_cache", "activations", "logits"))
    return parts


def layer_param_count(model: ModelLike) -> int:
    """Weights of one Llama / Qwen2 decoder block: its seven linear layers and two RMSNorms (biases left out)."""
    shape = ModelShape.of(model)
    (hidden,) = shape.ints("hidden")
    return sum(i * o for i, o in _linear_shapes(shape).values()) + 2 * hidden


__all__ = [
    "ModelShape", "model_from_config", "estimate_grpo_memory", "lora_param_count", "layer_param_count",
    "kv_cache_bytes_per_token", "activation_bytes_per_token", "logits_bytes_per_token", "layer_activation_bytes",
    "backward_work_bytes", "lm_head_bytes"
]
