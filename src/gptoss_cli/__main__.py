"""`python -m gptoss_cli` runs the command line."""

from .cli import main

main()
