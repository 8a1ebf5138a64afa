"""vit-pipeline: distributed pretraining and fine-tuning of Vision Transformers."""

__version__ = "0.1.0"
