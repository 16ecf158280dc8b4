"""What every layer shares, beneath them all: the step contract (``step.py``), files written
whole or not at all (``atomic.py``), and how an eyrie command ends (``exits.py``).

This layer uses nothing of eyrie's but memory/'s byte units.
"""
