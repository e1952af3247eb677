"""Model files: language models built locally (no download), saved in Hugging Face format so
that the code that loads real models loads them too; and safetensors written a tensor at a
time (hashed as written) or mapped back without a copy, for weight versions."""
