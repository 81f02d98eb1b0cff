"""`gptoss download` (being written)."""
