"""eyrie: an EAGLE-3 draft-model factory whose every memory outcome is recorded."""
