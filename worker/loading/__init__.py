"""From a model name to weights in memory: the model's source (directory, GGUF, repo id,
the demo), fetching, the GGUF reader, the safetensors loader, the tokenizer, the random
test-shaped models, and the per-node caches."""
