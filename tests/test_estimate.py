"""hf_perf_callbacks.estimate: hand-computed values, monotonicity, checkpointing, the fix of a swapping Mac run,
the per-token functions the analysis shares, the README table."""
import dataclasses
import importlib.util
import os
import re

import pytest

from hf_perf_callbacks.estimate import (
    HEAD_TILE_TEMP_BYTES,
    HEAD_TOKEN_CHUNK,
    HEAD_VOCAB_CHUNK,
    QWEN25,
    ModelShape,
    activation_bytes_per_token,
    backward_work_bytes,
    estimate_grpo_memory,
    kv_cache_bytes_per_token,
    layer_activation_bytes,
    lm_head_bytes,
    logits_bytes_per_token,
    lora_param_count,
    model_from_config,
)
from hf_perf_callbacks.train import recipes

SMALL = dict(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10, params=1000)
README = os.path.join(recipes.DIR, "README.md")


def _gib(value: float) -> str:
    """Bytes as GiB with two decimals, as the recipes' README tables show them."""
    return f"{value / 1024**3:.2f}"


def small(**overrides):
    settings = dict(micro_batch=2, num_generations=2, generation_batch=4, prompt_tokens=3, max_completion_length=5,
                    dtype_bytes=2, lora_params=100, activation_checkpointing=True)
    settings.update(overrides)
    return estimate_grpo_memory(SMALL, **settings)


def test_hand_computed_small_config():
    # seq = 3 + 5 = 8, tokens = 2 × 8 = 16; q_dim = 2 × 4 = 8
    # block bytes = 2·4·8 (fp32 norms) + 2·(4·8 + 3·16) (q, k, v, attention out; MLP) + 4·(8·5 + 8 + 16) (LoRA inputs)
    assert layer_activation_bytes(SMALL, 2) == 64 + 160 + 256
    assert backward_work_bytes(SMALL, 2) == 2 * (3 * 16 + 4 * 8)                        # 160
    head_per_token = HEAD_VOCAB_CHUNK * 2 + 10 * HEAD_TILE_TEMP_BYTES["torch"] + 8 * 6    # tile buffer, temps, hidden
    with_ckpt = small()
    expected = {
        "weights": 1000 * 2,
        "lora": 100 * 16,
        "kv_cache": 2 * 2 * 1 * 4 * 2 * 8 * 4,                 # 1024
        "prefill": 4 * (3 * 16 * (3 * 2 + 4) + 10 * (2 + 8)),  # 4 seqs × (prompt MLP + one step's logits)
        "activations": 2 * 8 * 2 * 16,                         # one saved input per block
        "logits": head_per_token * 16,                         # torch path: every position is scored
        "recompute": (480 + 160) * 16,
    }
    expected["generation"] = expected["kv_cache"] + expected["prefill"]
    expected["training"] = expected["activations"] + max(expected["logits"], expected["recompute"])
    expected["peak"] = 2000 + 1600 + max(expected["generation"], expected["training"])
    expected["total"] = 2000 + 1600 + 1024 + expected["activations"] + expected["logits"]
    assert with_ckpt == expected
    without = small(activation_checkpointing=False)
    assert without["activations"] == 2 * 480 * 16 and without["recompute"] == 160 * 16
    assert without["training"] == without["activations"] + max(without["logits"], without["recompute"])


def test_triton_head_scores_only_completions_in_place():
    torch_path, triton = small(), small(lm_head="triton")
    assert triton["logits"] == (HEAD_VOCAB_CHUNK * 2 + 8 * 6) * 2 * 5                    # 2 × 5 completion tokens
    assert triton["logits"] < torch_path["logits"]
    with pytest.raises(ValueError, match="lm_head='cuda'"):
        small(lm_head="cuda")


def test_head_tile_rows_stop_at_the_token_chunk():
    m = QWEN25["Qwen/Qwen2.5-0.5B-Instruct"]
    below = lm_head_bytes(m, HEAD_TOKEN_CHUNK)
    above = lm_head_bytes(m, 2 * HEAD_TOKEN_CHUNK)
    assert above - below == HEAD_TOKEN_CHUNK * m.hidden * 6                             # only the hidden part grows
    assert below == HEAD_TOKEN_CHUNK * logits_bytes_per_token(m)


def test_per_token_functions_by_hand():
    assert kv_cache_bytes_per_token(SMALL, 2) == 2 * 2 * 1 * 4 * 2                       # 32
    assert activation_bytes_per_token(SMALL, 2, True) == 2 * 8 * 2                       # saved block inputs
    assert activation_bytes_per_token(SMALL, 2, False) == 2 * 480
    assert activation_bytes_per_token(SMALL, 2, False, lora_input_bytes=0) == 2 * (64 + 160)
    assert logits_bytes_per_token(SMALL) == HEAD_VOCAB_CHUNK * 2 + 10 * 33 + 8 * 6
    est = small()                                                                         # seq 8, micro-batch 2
    assert est["kv_cache"] == kv_cache_bytes_per_token(SMALL, 2) * 8 * 4
    assert est["activations"] == activation_bytes_per_token(SMALL, 2, True) * 16
    assert est["logits"] == logits_bytes_per_token(SMALL) * 16
    with pytest.raises(ValueError, match="intermediate"):                     # only the keys they need are checked
        activation_bytes_per_token({k: v for k, v in SMALL.items() if k != "intermediate"}, 2, False)
    assert kv_cache_bytes_per_token({"layers": 2, "kv_heads": 1, "head_dim": 4}, 2) == 32
    with pytest.raises(ValueError, match="lora_targets"):
        layer_activation_bytes(SMALL, 2, 4, ("lm_head",))


# ---------------------------------------------------------------- the byte model against what PyTorch allocates
def _profiled_peak(fn) -> int:
    """Peak bytes of tensors created while ``fn`` runs, from torch.profiler's memory timeline (CPU)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    fn()                                                                          # warm: lazily created state
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
        fn()
    now = peak = 0
    for _, action, _, size in p._memory_profile().timeline:
        now += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, now)
    return peak


#: TRL's chunked log-prob head (trl.kernels, trl.trainer.utils.add_fused_lm_head), which the memory model describes,
#: came after TRL 1.0: on an older TRL (the oldest tested set) the tests that profile it against the model are skipped
_CHUNKED_HEAD = pytest.mark.skipif(importlib.util.find_spec("trl.kernels") is None,
                                   reason="this TRL has no chunked log-prob head (trl.kernels); the memory model "
                                          "describes TRL 1.16's")


def _qwen_lora_step(layers, checkpointing, micro=2, seq=32, vocab=512):
    """A real Qwen2 (bf16 weights) + PEFT LoRA r16 on all linear layers (fp32 adapters, no autocast) with TRL's
    fused head: one forward/backward of ``micro × seq`` tokens, as GRPO's loss runs it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config
    from trl.trainer.utils import add_fused_lm_head

    config = Qwen2Config(num_hidden_layers=layers, hidden_size=128, intermediate_size=384, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=True,
                         max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    ids = torch.randint(0, vocab, (micro, seq))
    labels = ids.clone()
    labels[:, : seq // 2] = -100

    def step():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, fused_lm_head=True)
        (out.log_probs.sum() + out.entropy.sum()).backward()
        model.zero_grad(set_to_none=False)                 # keep the LoRA gradients: they are counted apart
    return config, step


@_CHUNKED_HEAD
def test_block_bytes_match_what_autograd_keeps():
    """The per-layer slope of a real forward/backward (2 layers minus 1, no checkpointing) is
    layer_activation_bytes × tokens."""
    peaks = {}
    for layers in (1, 2):
        config, step = _qwen_lora_step(layers, checkpointing=False)
        peaks[layers] = _profiled_peak(step)
    model = model_from_config({**config.to_dict(), "params": 1})
    assert peaks[2] - peaks[1] == pytest.approx(layer_activation_bytes(model, 2, 4) * 2 * 32, rel=0.03)


@_CHUNKED_HEAD
@pytest.mark.parametrize("checkpointing", [True, False])
def test_training_part_matches_the_profiled_peak(checkpointing):
    """Activations, the head's tiles on its torch path (what MPS runs) and the backward's working set, together."""
    config, step = _qwen_lora_step(2, checkpointing=checkpointing)
    model = model_from_config({**config.to_dict(), "params": 1})
    est = estimate_grpo_memory(model, micro_batch=2, num_generations=2, generation_batch=2, prompt_tokens=16,
                               max_completion_length=16, dtype_bytes=2, lora_params=0,
                               activation_checkpointing=checkpointing)
    assert _profiled_peak(step) == pytest.approx(est["training"], rel=0.08)


def test_model_from_a_hugging_face_config():
    config = {"num_hidden_layers": 36, "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": None, "vocab_size": 151936, "params": 3_085_938_688}
    assert model_from_config(config) == QWEN25["Qwen/Qwen2.5-3B-Instruct"]
    assert model_from_config({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2}).kv_heads == 2
    assert model_from_config({**config, "tie_word_embeddings": False}).tie_word_embeddings is False


def test_a_model_dict_is_read_as_its_shape_and_a_missing_field_is_named():
    """The recipes' README passes a dict: it is read as the ModelShape of its keys (others left out)."""
    shape = QWEN25["Qwen/Qwen2.5-0.5B-Instruct"]
    as_dict = {**dataclasses.asdict(shape), "bytes": 2}
    assert ModelShape.of(as_dict) == shape
    assert kv_cache_bytes_per_token(as_dict, 2) == kv_cache_bytes_per_token(shape, 2) == 2 * 24 * 2 * 64 * 2
    with pytest.raises(ValueError, match=r"model is missing \['vocab'\]"):
        logits_bytes_per_token(dataclasses.replace(shape, vocab=None))
    with pytest.raises(ValueError, match="model=3 is not allowed"):
        kv_cache_bytes_per_token(3, 2)
    assert shape["layers"] == 24 and {**shape}["params"] == 494_032_768      # it still reads as the dict it was
    with pytest.raises(KeyError):
        shape["bytes"]


def test_lora_param_count_by_hand():
    # r × (in + out) per module: q 16, k 12, v 12, o 16, gate 24, up 24, down 24 = 128; × r 2 × layers 2
    assert lora_param_count(SMALL, r=2) == 512
    assert lora_param_count(SMALL, r=2, target_modules=("q_proj", "v_proj")) == 2 * 2 * (16 + 12)
    with pytest.raises(ValueError, match="lm_head"):
        lora_param_count(SMALL, r=2, target_modules=("lm_head",))


@pytest.mark.parametrize("name", sorted(QWEN25))
def test_qwen_table_is_self_consistent(name):
    m = QWEN25[name]
    assert m.heads * m.head_dim == m.hidden and m.vocab in (151936, 152064)
    assert m.tie_word_embeddings == (m.params < 7e9)                   # only the 7B has its own LM head
    h, i, kv = m.hidden, m.intermediate, m.kv_heads * m.head_dim
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h   # q/k/v with bias, o, MLP, 2 norms
    embeddings = m.vocab * h * (1 if m.tie_word_embeddings else 2)
    assert embeddings + m.layers * per_layer + h == m.params          # embeddings (+ LM head) + final norm


def test_longer_completions_and_larger_micro_batches_need_more():
    m = QWEN25["Qwen/Qwen2.5-1.5B-Instruct"]
    base = dict(micro_batch=2, num_generations=4, generation_batch=8, prompt_tokens=200, max_completion_length=128,
                dtype_bytes=2, lora_params=lora_param_count(m, 16), activation_checkpointing=True)
    ref = estimate_grpo_memory(m, **base)
    longer = estimate_grpo_memory(m, **{**base, "max_completion_length": 512})
    bigger = estimate_grpo_memory(m, **{**base, "micro_batch": 4})
    for key in ("kv_cache", "activations", "logits", "total"):
        assert longer[key] > ref[key]
    for key in ("activations", "logits", "total"):
        assert bigger[key] > ref[key]
    assert bigger["kv_cache"] == ref["kv_cache"] and bigger["weights"] == ref["weights"]


@pytest.mark.parametrize("name", sorted(QWEN25))
def test_checkpointing_reduces_activations(name):
    m = QWEN25[name]
    common = dict(micro_batch=2, num_generations=4, generation_batch=8, prompt_tokens=200, max_completion_length=128,
                  dtype_bytes=2, lora_params=0)
    on = estimate_grpo_memory(m, activation_checkpointing=True, **common)
    off = estimate_grpo_memory(m, activation_checkpointing=False, **common)
    assert on["activations"] < off["activations"] / 5
    assert on["total"] < off["total"]


def test_cutting_completions_512_to_128_cuts_the_completion_kv_cache_fourfold():
    # field report: a 3B + LoRA Wordle GRPO run on a Mac swapped (226 s instead of ~40 s per iteration) with
    # 512-token completions; completions used ~80 tokens and 128 fixed it
    m = QWEN25["Qwen/Qwen2.5-3B-Instruct"]
    common = dict(micro_batch=1, num_generations=2, generation_batch=2, prompt_tokens=0, dtype_bytes=2,
                  lora_params=lora_param_count(m, 16), activation_checkpointing=True)
    before = estimate_grpo_memory(m, max_completion_length=512, **common)
    after = estimate_grpo_memory(m, max_completion_length=128, **common)
    assert before["kv_cache"] == 4 * after["kv_cache"]
    assert before["total"] > after["total"]


@pytest.mark.parametrize("overrides, match", [
    (dict(generation_batch=3), "generation_batch=3"),
    (dict(num_generations=1, generation_batch=2), "num_generations=1"),
    (dict(micro_batch=0), "micro_batch=0"),
    (dict(prompt_tokens=-1), "prompt_tokens=-1"),
    (dict(activation_checkpointing="yes"), "activation_checkpointing"),
])
def test_invalid_inputs_name_the_parameter(overrides, match):
    with pytest.raises(ValueError, match=match):
        small(**overrides)


def test_missing_model_key_is_named():
    model = {k: v for k, v in SMALL.items() if k != "kv_heads"}
    with pytest.raises(ValueError, match="kv_heads"):
        estimate_grpo_memory(model, micro_batch=1, num_generations=2, generation_batch=2, prompt_tokens=0,
                             max_completion_length=8, dtype_bytes=2, lora_params=0, activation_checkpointing=True)


def test_readme_memory_table_matches_the_function():
    rows = [line for line in open(README, encoding="utf-8") if re.match(r"\| `[\w.-]+\.yaml` \|", line)]
    assert len(rows) == 5
    for row in rows:
        cells = [c.strip().strip("`") for c in row.strip().strip("|").split("|")]
        _, model, micro, gen, ckpt, head, inputs, *figures = cells
        m = QWEN25[f"Qwen/{model}"]
        prompts, ngen, gbs = (int(x) for x in re.match(r"(\d+) × (\d+) = (\d+)", gen).groups())
        assert prompts * ngen == gbs
        est = estimate_grpo_memory(m, micro_batch=int(micro), num_generations=ngen, generation_batch=gbs,
                                   prompt_tokens=200, max_completion_length=128, dtype_bytes=2,
                                   lora_params=lora_param_count(m, 16), activation_checkpointing=ckpt == "on",
                                   lm_head=head, lora_input_bytes={"fp32": 4, "bf16": 2}[inputs])
        keys = ("weights", "lora", "generation", "activations", "logits", "recompute", "peak")
        assert figures == [_gib(est[k]) for k in keys], row


@_CHUNKED_HEAD
def test_head_tile_bytes_match_trls_kernel():
    """TRL's ChunkedLogProbFunction (log-probs and entropy, forward and backward) on its torch path — the one MPS
    runs — holds logits_bytes_per_token per scored token: a vocabulary wider than one tile, 64 tokens."""
    import torch
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    torch.manual_seed(0)
    tokens, hidden, vocab = 64, 32, HEAD_VOCAB_CHUNK + 1000
    h = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,))

    def step():
        logps, entropy, *_ = ChunkedLogProbFunction.apply(h, w, None, targets, 1.0, HEAD_VOCAB_CHUNK, None, 1.0,
                                                          ("log_probs", "entropy"))
        (logps.sum() + entropy.sum()).backward()
    model = dict(vocab=vocab, hidden=hidden)
    assert _profiled_peak(step) == pytest.approx(lm_head_bytes(model, tokens), rel=0.03)
