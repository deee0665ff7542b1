"""ckptier: keep training checkpoints safe and cheap."""

__version__ = "0.1.0"
