"""The cross-rank agreement's gradient averaging, without a process group (one process, a planted second rank)."""


def test_gradient_average_stages_at_most_one_bucket_and_means_every_tensor(monkeypatch):
    # two ranks without a process group: the other rank holds 1.0 everywhere, so each mean is (value + 1) / 2.
    # A small bucket forces both paths (a tensor of a bucket or more on its own, smaller ones packed and flushed)
    import torch

    from hf_perf_callbacks.resize import agreement

    calls = []

    def all_reduce(t):
        calls.append((t.dtype, t.numel(), t.is_contiguous()))
        t.add_(1.0)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(agreement, "world_size", lambda: 2)
    monkeypatch.setattr(agreement, "AVERAGE_BUCKET_BYTES", 64)            # 16 fp32 or 32 bf16 elements
    tensors = [torch.arange(40, dtype=torch.float32).reshape(8, 5),  # 160 B: on its own
               torch.full((6,), 3.0), torch.full((7,), 5.0), torch.full((5,), 7.0),   # 72 B of small fp32
               torch.full((10,), 2.0, dtype=torch.bfloat16),
               torch.arange(20, dtype=torch.float32).reshape(4, 5).t()]           # non-contiguous, 80 B
    expected = [(t.float() + 1) / 2 for t in tensors]
    buffers = agreement.average_buffers(tensors)
    assert {d: b.numel() for d, b in buffers.items()} == {torch.float32: 16, torch.bfloat16: 10}
    agreement.average_across_ranks(tensors, buffers)
    for t, e in zip(tensors, expected):
        assert torch.allclose(t.float(), e, atol=1e-2)
    # in order: the large tensor alone, the packed 6 + 7 (the 5 would overflow the 16-element buffer), the
    # non-contiguous one alone (through a contiguous copy), then the last packed fp32 and bf16 buffers
    assert calls == [(torch.float32, 40, True), (torch.float32, 13, True), (torch.float32, 20, True),
                     (torch.float32, 5, True), (torch.bfloat16, 10, True)]
