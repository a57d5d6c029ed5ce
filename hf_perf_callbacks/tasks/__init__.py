"""Bundled offline tasks for demos and recipes."""
