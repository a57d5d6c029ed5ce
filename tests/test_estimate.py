"""hf_perf_callbacks.estimate: hand-computed values, monotonicity, checkpointing, the fix of a swapping Mac run,
the per-token functions the analysis shares, the README table."""
import os
import re

import pytest

from hf_perf_callbacks.estimate import (QWEN25, activation_bytes_per_token, estimate_grpo_memory, format_gib,
                                        kv_cache_bytes_per_token, layer_activation_elements, logits_bytes_per_token,
                                        lora_param_count, model_from_config)

SMALL = dict(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10, params=1000)
README = os.path.join(os.path.dirname(__file__), "..", "recipes", "README.md")


def small(**overrides):
    settings = dict(micro_batch=2, num_generations=2, generation_batch=4, prompt_tokens=3, max_completion_length=5,
                    dtype_bytes=2, lora_params=100, activation_checkpointing=True)
    settings.update(overrides)
    return estimate_grpo_memory(SMALL, **settings)


def test_hand_computed_small_config():
    # seq = 3 + 5 = 8, tokens = 2 × 8 = 16, per-layer elements = 6·8 + 2·1·4 + 4·16 = 120
    assert layer_activation_elements(SMALL) == 120
    with_ckpt = small()
    assert with_ckpt == {
        "weights": 1000 * 2,
        "lora": 100 * 16,
        "kv_cache": 2 * 2 * 1 * 4 * 2 * 8 * 4,                 # 1024
        "activations": 2 * 8 * 16 * 2 + 120 * 16 * 2,          # 512 + 3840
        "logits": 2 * 8 * 10 * 4,                              # 640
        "total": 2000 + 1600 + 1024 + 4352 + 640,
    }
    without = small(activation_checkpointing=False)
    assert without["activations"] == 2 * 120 * 16 * 2
    assert without["total"] == 2000 + 1600 + 1024 + 7680 + 640


def test_per_token_functions_by_hand():
    assert kv_cache_bytes_per_token(SMALL, 2) == 2 * 2 * 1 * 4 * 2                       # 32
    assert activation_bytes_per_token(SMALL, 2, True) == (2 * 8 + 120) * 2               # 272
    assert activation_bytes_per_token(SMALL, 2, False) == 2 * 120 * 2                    # 480
    assert logits_bytes_per_token(SMALL) == 10 * 4
    est = small()                                                                         # seq 8, micro-batch 2
    assert est["kv_cache"] == kv_cache_bytes_per_token(SMALL, 2) * 8 * 4
    assert est["activations"] == activation_bytes_per_token(SMALL, 2, True) * 16
    assert est["logits"] == logits_bytes_per_token(SMALL) * 16
    with pytest.raises(ValueError, match="intermediate"):                     # only the keys they need are checked
        activation_bytes_per_token({k: v for k, v in SMALL.items() if k != "intermediate"}, 2, True)
    assert kv_cache_bytes_per_token({"layers": 2, "kv_heads": 1, "head_dim": 4}, 2) == 32


def test_model_from_a_hugging_face_config():
    config = {"num_hidden_layers": 36, "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": None, "vocab_size": 151936, "params": 3_085_938_688}
    model = model_from_config(config)
    assert model == {k: v for k, v in QWEN25["Qwen/Qwen2.5-3B-Instruct"].items() if k in model}
    assert model_from_config({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2})["kv_heads"] == 2


def test_lora_param_count_by_hand():
    # r × (in + out) per module: q 16, k 12, v 12, o 16, gate 24, up 24, down 24 = 128; × r 2 × layers 2
    assert lora_param_count(SMALL, r=2) == 512
    assert lora_param_count(SMALL, r=2, target_modules=("q_proj", "v_proj")) == 2 * 2 * (16 + 12)
    with pytest.raises(ValueError, match="lm_head"):
        lora_param_count(SMALL, r=2, target_modules=("lm_head",))


@pytest.mark.parametrize("name", sorted(QWEN25))
def test_qwen_table_is_self_consistent(name):
    m = QWEN25[name]
    assert m["heads"] * m["head_dim"] == m["hidden"]
    assert (m["vocab"], m["tie_word_embeddings"]) == ((151936, True) if "7B" not in name else (152064, False))
    h, i, kv = m["hidden"], m["intermediate"], m["kv_heads"] * m["head_dim"]
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h   # q/k/v with bias, o, MLP, 2 norms
    embeddings = m["vocab"] * h * (1 if m["tie_word_embeddings"] else 2)       # the 7B has its own LM head
    assert embeddings + m["layers"] * per_layer + h == m["params"]            # + final norm


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
        _, model, micro, gen, ckpt, lora_r, weights, lora, kv, act, logits, total = cells
        m = QWEN25[f"Qwen/{model}"]
        prompts, ngen, gbs = (int(x) for x in re.match(r"(\d+) × (\d+) = (\d+)", gen).groups())
        assert prompts * ngen == gbs
        est = estimate_grpo_memory(m, micro_batch=int(micro), num_generations=ngen, generation_batch=gbs,
                                   prompt_tokens=200, max_completion_length=128, dtype_bytes=2,
                                   lora_params=lora_param_count(m, int(lora_r)),
                                   activation_checkpointing=ckpt == "on")
        assert [weights, lora, kv, act, logits, total] == [format_gib(est[k]) for k in
                                                           ("weights", "lora", "kv_cache", "activations", "logits",
                                                            "total")], row
