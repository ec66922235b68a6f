"""Training the embedded default: corpus, tokenizer, the differentiable K3+DSA model, the training loop, export."""
