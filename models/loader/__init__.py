"""Weight and tokenizer loading from HF directories (safetensors) and GGUF files. No pickle."""
