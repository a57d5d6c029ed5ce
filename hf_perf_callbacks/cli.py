"""The ``hf-perf`` command line: ``demo``."""
from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-perf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="offline GRPO+LoRA Wordle demo with every callback attached")
    demo.add_argument("--output_dir", default="demo_output", help="where the run and its perf log go")
    demo.add_argument("--max_steps", type=int, default=30)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        if args.max_steps < 1:
            parser.error(f"--max_steps={args.max_steps} is not allowed: expected an integer >= 1")
        from .demo import run_demo

        run_demo(args.output_dir, max_steps=args.max_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
