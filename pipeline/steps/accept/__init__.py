"""The acceptance step: the exported draft against its target, accept length and tokens/s."""
