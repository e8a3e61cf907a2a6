"""Text in and out of the engine: tokenizers (HF or GGUF) with chat templates, and incremental detokenization
with stop strings."""
