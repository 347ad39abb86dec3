"""The bootstrap registry: server, supervised health loop, encoder-side registration."""
