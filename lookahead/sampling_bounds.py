"""The range of sampling settings the command line and the server accept, importable without torch (the
`lookahead` command checks its flags before it imports torch and transformers)."""

# Smallest sampling temperature the CLI and the server accept: far below it, scores / temperature overflow
# float32 to +-inf and the softmax has no distribution (`sampling.probs_from_scores` raises); 1e-5 is ~argmax already.
MIN_TEMPERATURE = 1e-5
