"""Leaf helpers every floor of the package may use; they import nothing of gnetmdk (docs/architecture.md,
"Floors"): atomic file writes (``atomic``), the record of what a run computes with (``environment``).
"""
