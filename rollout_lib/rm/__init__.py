"""Bradley-Terry reward models: pairs -> tokens (`pairs`), the trainer (`trainer`), held-out accuracy and scoring
(`evaluate`), a finished checkpoint used again (`checkpoints`)."""
