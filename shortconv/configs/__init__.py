"""Configuration: model and engine configs, transformers config reading, support."""
