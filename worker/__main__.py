"""`python -m worker` is the `ratchet` command."""

from worker.cli import main

main()
