"""Model files: language models built locally (no download), saved in Hugging Face format so
that the code that loads real models loads them too; and safetensors written a tensor at a
time (hashed as written) or mapped back without a copy, for weight versions."""

# The names tied embeddings go by in Hugging Face checkpoints: some writers save the output
# projection, others leave it to the input embedding.
TIED_INPUT, TIED_OUTPUT = "model.embed_tokens.weight", "lm_head.weight"
