"""`python -m mtrain` (and `torchrun -m mtrain`) runs the CLI."""

from mtrain.cli import app

if __name__ == "__main__":
    app()
