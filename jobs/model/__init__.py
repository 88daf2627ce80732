"""The model: loading the base, its tokenizer and GGUF weights, the LoRA adapter and compile
(`loading`), and the checks of an adapter directory read from disk (`adapter_check`)."""
