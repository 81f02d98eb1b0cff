"""The inference runtime: checkpoints, reference model, engines, tokenizer and harmony format.

Never imports typer, rich or prompt_toolkit.
"""
