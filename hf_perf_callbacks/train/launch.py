"""The launch: the command line parsed and checked (:func:`parse_recipe`), the trainer built and trained with a
compact console (:func:`run`), the model saved and the perf report written; :func:`main` is ``hf-perf train`` and
``python -m hf_perf_callbacks.train``."""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..core.batching import Split
from . import arguments, checks, interrupts, recipes
from .arguments import RecipeArguments, RecipeError
from .build import build_callbacks, build_datasets, build_model, build_tokenizer, resolve_reward_funcs

if TYPE_CHECKING:
    from transformers import Trainer, TrainerCallback
    from trl import GRPOConfig, ModelConfig

    from ..common.console import Console

logger = logging.getLogger("hf_perf_callbacks.train")   # also when run as __main__


@dataclass
class CheckedRecipe:
    """A command line that passed :func:`check_early`: the recipe file, the other arguments, the merged values
    (YAML under flags, the defaults of every field) and the split a batch tuner recorded for this resume."""

    config_path: str | None
    rest: list[str]
    values: dict[str, Any]
    split: dict[str, int] | None
    device: str = "cpu"                        # the device kind the trainer will use (detect_device)
    given: frozenset[str] = frozenset()        # the keys the YAML or a flag sets


def check_early(argv: list[str]) -> CheckedRecipe:
    """Every check of ``argv`` that needs no torch, transformers or TRL trainer (the package docstring lists them,
    with the evaluation batch, the dataset size and the checkpoint to resume from; the fields come from TRL's and
    transformers' sources: :func:`early_classes`): a :class:`RecipeError` in about a second."""
    config_path, rest = arguments.split_config(argv)
    arguments.check_trl_command(rest)
    config_path = recipes.resolve(config_path) if config_path else None
    config = arguments.read_recipe(config_path) if config_path else {}
    parser = arguments.make_parser(arguments.early_classes())
    source = config_path or "recipe"
    arguments.check_trl_keys(config, rest, config_path)
    arguments.check_keys(parser, config, rest, source=source)
    arguments.check_values(config, source=source, parser=parser)
    values = arguments.raw_values(parser, config, rest)
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)    # accelerate launch / torchrun
    split = checks.split_to_resume(values, world_size)
    if split:
        values.update(split)
        if split.get("steps_per_generation"):
            values["generation_batch_size"] = None
    checks.check_callback_arguments(values.get("callbacks"), values.get("callback_kwargs"))
    checks.check_resume(values.get("resume_from_checkpoint"), values.get("output_dir"))
    kind, bf16_ok, name = checks.detect_device(bool(values.get("use_cpu")))
    checks.check_recipe(values, device=kind, bf16_supported=bf16_ok, device_name=name, world_size=world_size,
                        accelerate_mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION"))
    given = frozenset(config) | {arg.split("=", 1)[0][2:].replace("-", "_") for arg in rest if arg.startswith("--")}
    return CheckedRecipe(config_path, rest, values, split, kind, given)


def parse_recipe(argv: list[str]) -> tuple[RecipeArguments, GRPOConfig, ModelConfig]:
    """Validate and parse ``argv`` into ``(RecipeArguments, GRPOConfig, ModelConfig)``: :func:`check_early` first,
    then the real classes parse it; a :class:`RecipeError` comes before anything heavy (distributed init, model,
    data) happens."""
    checked = check_early(argv)
    values, split = checked.values, checked.split
    if os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16" and values.get("bf16") is False:
        logger.warning("accelerate's mixed_precision: bf16 overrides the recipe's bf16: false; --mixed_precision no "
                       "keeps the recipe's precision")

    args = ["--config", checked.config_path, *checked.rest] if checked.config_path else checked.rest
    recipe, training_args, model_args = arguments.make_parser(arguments.recipe_classes()).parse_args_and_config(args)
    if split:
        logger.info("applying the split recorded by the batch tuner in %s: %s", training_args.output_dir, split)
        training_args = checks.config_with_split(training_args, split)
    if checked.device == "cpu" and "dataloader_pin_memory" not in checked.given:
        training_args.dataloader_pin_memory = False    # nothing to pin for (torch warns once per dataloader)
    recipe.callbacks = checks.callback_names(recipe.callbacks)
    recipe.reward_funcs = [recipe.reward_funcs] if isinstance(recipe.reward_funcs, str) else recipe.reward_funcs
    recipe.callback_kwargs = arguments.as_dict(recipe.callback_kwargs, "callback_kwargs")
    training_args.resume_from_checkpoint = checks.resolve_checkpoint(training_args.resume_from_checkpoint,
                                                                     training_args.output_dir)
    return recipe, training_args, model_args


# ---------------------------------------------------------------- the console
def compact_console(trainer: Trainer) -> Console:
    """The trainer's console: its printers (transformers' ``ProgressCallback``, or ``PrinterCallback`` under
    ``disable_tqdm``) print the compact log (:meth:`~hf_perf_callbacks.common.console.Console.compact`); what the
    reporters, ``log_history`` and the perf log receive is unchanged."""
    from ..common.console import Console

    console = Console()
    console.handler = trainer.callback_handler
    console.compact()
    return console


def _describe(recipe: RecipeArguments, args: GRPOConfig, model_args: ModelConfig,
              callbacks: list[TrainerCallback]) -> str:
    world, split = args.world_size, Split(args.per_device_train_batch_size, args.gradient_accumulation_steps)
    lora = f", LoRA r={model_args.lora_r}" if model_args.use_peft else ""
    names = ", ".join(type(cb).__name__ for cb in callbacks) or "none"
    prompts = cast(int, args.generation_batch_size) // cast(int, args.num_generations)  # both set by __post_init__
    return (f"recipe: {model_args.model_name_or_path} ({model_args.dtype}{lora}) on {args.device.type} × {world}\n"
            f"micro-batch {split.micro_batch} × accumulation {split.grad_accum} × world {world} = "
            f"{split.effective_batch(world)} completions per "
            f"optimizer step; generation batch {args.generation_batch_size} = "
            f"{prompts} prompt{'' if prompts == 1 else 's'} × {args.num_generations}; "
            f"max_completion_length {args.max_completion_length}\ndataset {recipe.dataset}; callbacks {names}")


def _report(output_dir: str) -> None:
    """End-of-run report; a failure here is logged and does not fail the finished run."""
    try:
        from ..report import report_command

        report_command(output_dir, summary=False)    # the callbacks printed their summaries as training ended
    except Exception:                                  # training and checkpoints are already saved
        logger.exception("the perf report failed; rerun it with `hf-perf report %s`", output_dir)


def _end(trainer: Trainer) -> None:
    """Finish the trackers and destroy the process group (``Trainer.end``).

    Several processes meet at a barrier first and then sleep briefly without the GIL: gloo's process-group
    destructor joins its worker thread while holding the GIL, and deadlocks when that thread still has to release
    the last collective's tensors (pytorch/pytorch#56297, #75097; seen on 2-process CPU runs).
    """
    if trainer.args.world_size > 1:
        trainer.accelerator.wait_for_everyone()
        time.sleep(0.5)
    trainer.end()                                      # type: ignore[no-untyped-call]  # untyped in transformers


# ---------------------------------------------------------------- what the recipe was written for
#: the recipe keys that size a run's memory: a report on a run that stood in for the recipe's target (another model,
#: device or completion length) advises no value of them that costs more memory than the recipe's own
MEMORY_KEYS = ("activation_checkpointing", "gradient_checkpointing", "per_device_train_batch_size",
               "max_completion_length", "num_generations", "vllm_gpu_memory_utilization", "dtype", "use_peft")


def recipe_target(argv: list[str]) -> dict[str, Any]:
    """What the recipe of ``--config`` was written for, before any command-line override (the run header's
    ``target``): its name, the machine its first line names and that machine's device type, its model and completion
    length, its values of :data:`MEMORY_KEYS`; {} without a recipe file."""
    config_path, _ = arguments.split_config(argv)
    if not config_path:
        return {}
    path = recipes.resolve(config_path)
    config = arguments.read_recipe(path)
    machine = recipes.machine(path)
    device = "mps" if "Apple" in machine else "cuda" if "NVIDIA" in machine or "GPU" in machine else None
    return {"recipe": os.path.basename(path).removesuffix(".yaml"), "machine": machine, "device_type": device,
            "model": config.get("model_name_or_path"), "max_completion_length": config.get("max_completion_length"),
            "memory": {k: config[k] for k in MEMORY_KEYS if k in config}}


# ---------------------------------------------------------------- entry point
def run(recipe: RecipeArguments, training_args: GRPOConfig, model_args: ModelConfig,
        target: Mapping[str, Any] | None = None) -> int:
    """Build the trainer from parsed arguments, train, save, report (``target``: :func:`recipe_target`)."""
    from trl import GRPOTrainer, get_peft_config

    from ..common.console import hide_upstream_deprecations
    from ..common.outputdir import OutputDirLock
    from ..demo import set_threads
    from .progress import StepPulse

    hide_upstream_deprecations()
    main_rank = int(os.environ.get("RANK", "0") or 0) == 0
    threads = set_threads()                            # as the demo chooses them; OMP_NUM_THREADS kept
    if main_rank:
        logger.info("%s", threads)
    callbacks = build_callbacks(recipe.callbacks, arguments.as_dict(recipe.callback_kwargs, "callback_kwargs"))
    lock = OutputDirLock() if callbacks and main_rank else None
    if lock is not None:               # before the model loads (the bus holds the same lock during train())
        lock.acquire(cast(str, training_args.output_dir))        # set by __post_init__; OutputDirBusy: see main
    # max_completion_length: None is no GRPO run (TRL's trainer computes with it)
    rewards = resolve_reward_funcs(recipe.reward_funcs, cast(int, training_args.max_completion_length))
    tokenizer = build_tokenizer(model_args, training_args)
    train_data, eval_data = build_datasets(recipe, training_args.seed,
                                           conversational=getattr(tokenizer, "chat_template", None) is not None)
    model = build_model(model_args, training_args)
    if eval_data is not None and training_args.eval_strategy == "no":
        logger.warning("eval_dataset_size=%d but eval_strategy is 'no': set eval_strategy: steps to evaluate",
                       recipe.eval_dataset_size)
    try:
        trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=training_args, train_dataset=train_data,
                              eval_dataset=eval_data, processing_class=tokenizer,
                              peft_config=get_peft_config(model_args) if model_args.use_peft else None,
                              callbacks=callbacks)
    except ValueError as error:                        # TRL's and transformers' checks of the arguments
        raise RecipeError(f"GRPOTrainer refused the recipe: {error}") from None
    interrupts.running(trainer)
    pulse = StepPulse(compact_console(trainer).say)    # a slow step's signs of life, above the progress bar
    trainer.add_callback(pulse)
    pulse.watch(trainer)
    if trainer.is_world_process_zero():
        for line in _describe(recipe, training_args, model_args, callbacks).splitlines():   # short lines
            logger.info("%s", line)

    if callbacks:                                      # the report words its advice as this launcher's recipe keys
        from ..common.bus import bus_for
        from ..core.runlog import HF_PERF_TRAIN

        bus_for(trainer.callback_handler).log.mark_runs(launcher=HF_PERF_TRAIN, target=dict(target or {}))
    resume = training_args.resume_from_checkpoint
    if any(type(cb).__name__ == "AdaptiveBatchTuner" for cb in callbacks):
        from ..resize import train_with_tuning

        train_with_tuning(trainer, resume_from_checkpoint=resume, tune=recipe.tune)
    else:
        trainer.train(resume_from_checkpoint=resume)
    pulse.stop()

    if getattr(trainer, "is_fsdp_enabled", False):    # checkpoints stay sharded; the final model is one loadable file
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(training_args.output_dir)
    main_process = trainer.is_world_process_zero()
    if main_process:
        trainer.save_state()
    _end(trainer)
    if lock is not None:
        lock.release()                                 # the bus released it when train() ended: a no-op then
    if main_process and recipe.report:
        _report(cast(str, training_args.output_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Launch a recipe: ``--config R.yaml [--key value ...]``; 0 on success, 2 on an invalid recipe."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("hf_perf_callbacks").setLevel(logging.INFO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        recipe, training_args, model_args = parse_recipe(argv)
    except ValueError as error:                        # RecipeError and the dataclasses' own checks
        print(f"hf_perf_callbacks.train: error: {error}", file=sys.stderr)
        return 2
    from ..common.outputdir import OutputDirBusy

    try:
        with interrupts.answered(cast(str, training_args.output_dir)):
            return run(recipe, training_args, model_args, target=recipe_target(argv))
    except (RecipeError, OutputDirBusy) as error:      # another live process in output_dir: one line, no traceback
        text = (f"output_dir {error.output_dir} is in use by another run ({error.holder}): pick another or wait for it"
                if isinstance(error, OutputDirBusy) else str(error))
        print(f"hf_perf_callbacks.train: error: {text}", file=sys.stderr)
        return 2
    except interrupts.Interrupted as stopped:          # Ctrl-C or SIGTERM: one line, the launcher's flag
        print(f"hf_perf_callbacks.train: {stopped.line}", file=sys.stderr)
        return stopped.status

