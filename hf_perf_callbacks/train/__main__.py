"""``python -m hf_perf_callbacks.train`` (and ``accelerate launch -m hf_perf_callbacks.train``): the recipe launcher."""
import sys

from . import main

sys.exit(main())
