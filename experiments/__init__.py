"""Studies on top of the trainer (format ablation); run from the repository root."""
