"""mtrain: train post-norm Transformer translation models from scratch, and use them."""

__version__ = "0.1.0"
