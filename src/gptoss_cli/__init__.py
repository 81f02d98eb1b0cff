"""gptoss: a command-line tool and single-GPU inference engine for gpt-oss-20b and gpt-oss-120b.

Importing this package is cheap: torch and the runtime load only when a command needs them.
"""

__version__ = "0.1.0"
