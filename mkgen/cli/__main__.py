"""`python -m mkgen.cli`: the same as the `mkgen` command."""

from mkgen.cli import main

main()
