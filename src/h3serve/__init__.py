"""h3serve: a native PyTorch inference engine and HTTP service for MiniMax-H3."""

__version__ = "0.1.0"
