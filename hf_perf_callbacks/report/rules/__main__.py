"""``python -m hf_perf_callbacks.report.rules``: print the README's rule table (from the rules' cards)."""
from . import rule_table

print(rule_table())
