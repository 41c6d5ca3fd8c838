"""Where the project's own files are: the checkout root (configs/, data/, the packages)."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
