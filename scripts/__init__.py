"""Training and publishing scripts, run from the repository root as modules (python -m scripts.publish)."""
