"""`python -m compiledllm`: the command line (cli.py)."""
from compiledllm.cli import main

main()
