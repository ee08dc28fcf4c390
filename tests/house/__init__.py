"""The house rules: the package's floors and rooms (ARCHITECTURE.md), ruff and mypy."""
