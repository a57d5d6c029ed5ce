"""Recipe launcher: GRPO + LoRA with the project's callbacks, configured by one YAML file.

```bash
accelerate launch --config_file "$(hf-perf recipes path accelerate/mps)" -m hf_perf_callbacks.train \\
    --config mac-16gb-qwen1.5b [--key value ...]
python -m hf_perf_callbacks.train --config mac-16gb-qwen1.5b      # one process
hf-perf train --config mac-16gb-qwen1.5b                          # same
hf-perf train --config my.yaml                                    # a recipe file (a path that exists wins)
```

``--config`` takes a packaged recipe's name (:mod:`hf_perf_callbacks.train.recipes`) or a YAML file. Keys are fields of
``RecipeArguments``, TRL's ``GRPOConfig`` and ``ModelConfig`` (TRL's ``TrlParser`` over the three);
command-line flags override the YAML. Unknown keys, values of the wrong type, impossible batch geometry, callback
arguments the callback does not take and precision the device lacks fail before torch, transformers and TRL's
trainers are imported, with the fix in the message; a model that cannot be loaded and a trainer that refuses its
arguments fail before training starts: one line, exit 2. Ctrl-C and SIGTERM end a run in one line with the flag
that resumes it (exit 130 or 143).

| module | what |
|---|---|
| ``schema`` | the fields of ``GRPOConfig``, ``ModelConfig`` and the callbacks read from their sources (no import) |
| ``arguments`` | the recipe's keys and values: ``RecipeArguments``, the parser, unknown keys, ``trl grpo``'s, types |
| ``checks`` | the values against the machine and the run: batch geometry, bf16, MPS, callback arguments, recorded |
|            | split, checkpoint |
| ``build`` | the trainer's parts: callbacks, reward functions, datasets, tokenizer, model |
| ``progress`` | a slow step's signs of life (``StepPulse``) and what the first step does |
| ``interrupts`` | Ctrl-C and SIGTERM: one line with ``--resume_from_checkpoint``, the resume advice as the flag |
| ``launch`` | ``check_early`` (the checks, before torch), ``parse_recipe`` (then the real classes), ``run`` (build, |
|            | train, save, report), ``main`` |
| ``recipes`` | the recipes folder: list, locate, copy (``hf-perf recipes``) |
"""
from __future__ import annotations

from .arguments import QUICK_TRIAL, RecipeArguments, RecipeError, field_names, launcher_help
from .launch import main, parse_recipe, run

__all__ = ["QUICK_TRIAL", "RecipeArguments", "RecipeError", "field_names", "launcher_help", "main", "parse_recipe",
           "run"]
