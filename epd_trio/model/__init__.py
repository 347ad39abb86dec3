"""Model adapters, encoder-only loading, media and preprocessing, tiny-model maker."""
