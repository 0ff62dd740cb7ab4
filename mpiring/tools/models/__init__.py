"""Small models for the training job and the tests (plain PyTorch)."""
