"""`python -m lookahead.cli ...` (as torchrun needs: `torchrun --nproc-per-node 2 -m lookahead.cli generate --tp`)."""

from lookahead.cli.entry import main

main()
