"""What is done with a trained adapter: held-out evaluation (`evaluate`, and
`evaluate_preference` for pairs) and export (`export`: merged weights, GGUF)."""
