"""`gptoss run` (being written)."""
