"""Language models built locally (no download), saved in Hugging Face format so that the
code that loads real models loads them too."""
