"""The reference model: its config and presets, the layers and the transformer, the vision tower, the sampler and device memory."""
