"""The training step: an EAGLE-3 draft head distilled from the target (see loop.py)."""
