"""FLOPs-per-token formulas against hand-computed values, and the shape read off a real (PEFT) model."""
import pytest

from hf_perf_callbacks.core.flops import (
    MatmulCount,
    attention_flops_per_token,
    forward_flops_per_token,
    shape_of,
    train_flops_per_token,
)


def test_full_finetune_is_6n_plus_3a():
    shape = MatmulCount(frozen_matmul_params=0, trainable_matmul_params=1000, num_layers=2, attention_dim=8)
    assert attention_flops_per_token(shape, 16) == 4 * 2 * 8 * 16 == 1024
    model, hardware = train_flops_per_token(shape, 16)
    assert model == hardware == 6 * 1000 + 3 * 1024


def test_lora_skips_the_frozen_weight_gradient():
    shape = MatmulCount(frozen_matmul_params=1000, trainable_matmul_params=10, num_layers=2, attention_dim=8)
    model, hardware = train_flops_per_token(shape, 16)
    assert model == 4 * 1010 + 2 * 10 + 3 * 1024 == 7132      # 4N_base + 6N_lora + 3A
    assert hardware == model


def test_recompute_counts_in_hardware_flops_only():
    shape = MatmulCount(1000, 10, 2, 8)
    model, hardware = train_flops_per_token(shape, 16, recompute=True)
    assert model == 7132
    assert hardware == 7132 + forward_flops_per_token(shape, 16) == 7132 + 2 * 1010 + 1024


def test_shape_of_tiny_llama_with_lora(tokenizer):
    from peft import LoraConfig, get_peft_model

    from hf_perf_callbacks.tiny import build_model

    model = build_model(tokenizer, hidden=64, layers=2, heads=4)
    vocab = model.config.vocab_size
    dense = 2 * (4 * 64 * 64 + 3 * 64 * 128) + 64 * vocab    # attention + gated MLP per layer, and the LM head
    full = shape_of(model)
    assert (full.frozen_matmul_params, full.trainable_matmul_params) == (0, dense)
    assert (full.num_layers, full.attention_dim) == (2, 64)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    lora = shape_of(peft)
    assert lora.frozen_matmul_params == dense
    assert lora.trainable_matmul_params == 2 * 2 * (4 * 64 + 64 * 4)   # A and B of q and v in 2 layers


def test_negative_sequence_length_is_rejected():
    with pytest.raises(ValueError, match="seq_len"):
        forward_flops_per_token(MatmulCount(1, 1, 1, 1), -1)
