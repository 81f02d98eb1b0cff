"""`gptoss bench` (being written)."""
