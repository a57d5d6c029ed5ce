"""Run under ``torch.distributed.run --nproc_per_node 2`` (gloo, CPU): GRPO with the meter on two ranks, generating
through vLLM in server mode (TRL's own client against the stand-in server that rank 0 starts on 127.0.0.1, port 0),
vLLM colocate (a stand-in ``vllm.LLM`` on each rank) and HF ``generate``, with costs in real time: ``GENERATE_SEC``
per engine call, ``TENSOR_SEC`` per weight tensor received (``tests/vllm_double.py`` says what is stood in and why).

Each rank writes, per backend, its meter's phase seconds, the figures it logged and what the engines spent to
``<out>/rank<R>.json``. A rank still running after ``HANG_DUMP_SEC`` (default 300) prints its stacks and exits.
"""
import faulthandler
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist

GENERATE_SEC = 2.0          # per engine call: one completions request (server), one LLM.generate or model.generate
TENSOR_SEC = 0.1            # per weight tensor the server or the colocated engine receives
LENGTHS = [3, 5, 7, 9, 4, 11]


def run(backend, tokenizer, out, model_dir, server_url, script):
    from transformers import AutoModelForCausalLM

    from hf_perf_callbacks import ThroughputMeter, keys
    from tests.conftest import make_grpo

    meter = ThroughputMeter()
    extra = {}
    if backend != "transformers":
        extra = dict(use_vllm=True, vllm_mode=backend.removeprefix("vllm-"), vllm_server_base_url=server_url)
    trainer = make_grpo(tokenizer, os.path.join(out, backend), [meter], max_steps=3, extra=extra,
                        model=AutoModelForCausalLM.from_pretrained(model_dir))
    calls = []
    if backend == "transformers":               # the engine's cost inside the model's own generate
        generate = trainer.model.generate

        def slow_generate(*args, **kwargs):
            started = time.perf_counter()
            time.sleep(GENERATE_SEC)
            output = generate(*args, **kwargs)          # the tiny model's own decode: real work on top
            calls.append((int((output[:, kwargs["input_ids"].shape[-1]:] != tokenizer.pad_token_id).sum()),
                          time.perf_counter() - started))
            return output

        trainer.model.generate = slow_generate
    trainer.train()
    logged = [{k: h.get(k) for k in (keys.PERF_ROLLOUT_TOKENS_PER_SEC, keys.PERF_TOKENS_PER_SEC)}
              for h in trainer.state.log_history if "loss" in h]
    return {"phase_sec": dict(meter.timeline.phase_totals), "logged": logged, "steps": trainer.state.global_step,
            "engine_calls": len(script.generate_calls), "engine_tokens": [c["tokens"] for c in script.generate_calls],
            "syncs": list(script.syncs), "hf_tokens": [c[0] for c in calls], "hf_sec": [c[1] for c in calls]}


def main(out):
    from accelerate import PartialState

    from hf_perf_callbacks.tiny import build_model, build_tokenizer
    from tests.conftest import CORPUS
    from tests.vllm_double import EngineScript, StandInServer, stand_in

    PartialState(cpu=True)                      # the process group (gloo), as the trainers' accelerator makes it
    rank = int(os.environ["RANK"])
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    model_dir = os.path.join(out, "model")
    if rank == 0:
        build_model(tokenizer).save_pretrained(model_dir)
    dist.barrier()
    result = {"rank": rank}
    for backend in ("vllm-server", "vllm-colocate", "transformers"):
        script = EngineScript(GENERATE_SEC, TENSOR_SEC, LENGTHS, list(range(20, 80)), tokenizer.eos_token_id)
        stand_in(None, script)
        server = StandInServer(script).__enter__() if rank == 0 else None
        urls = [server.url if server else None]
        dist.broadcast_object_list(urls, src=0)
        try:
            result[backend] = run(backend, tokenizer, out, model_dir, urls[0], script)
        finally:
            if server is not None:
                server.__exit__(None, None, None)
        dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(int(os.environ.get("HANG_DUMP_SEC", "300")), exit=True)
    main(sys.argv[1])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
