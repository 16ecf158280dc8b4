"""The tokenize step: conversations -> parquet shards of input_ids and an assistant-only loss
mask (see run.py)."""
