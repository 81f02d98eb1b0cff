"""`gptoss chat` (being written)."""
