"""Supervised fine-tuning: conversations -> tokens and loss masks (`tokenize`) -> every step's micro-batches
(`batches`) -> `trainer.causal.CausalLmTrainer` -> held-out loss (`evaluate`)."""
