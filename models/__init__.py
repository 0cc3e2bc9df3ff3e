"""Model architectures (DeepSeek-V2/V3, Llama), their configs and weight loading."""
