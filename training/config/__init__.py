"""The recipe and DeepSpeed config: their schema, validation and the automatic choice."""
