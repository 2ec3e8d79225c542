"""Model loading: GGUF files and Hugging Face directories into one in-memory form."""
