"""Generate with the Python API: render a harmony prompt, run the engine, parse the channels.

    python examples/generate.py [MODEL]      (default random:tiny; a checkpoint dir on a GPU machine)
"""

import sys

from gptoss_cli.runtime.api import SamplingParams
from gptoss_cli.runtime.harmony import Message, SystemConfig, parse_completion, render_prompt
from gptoss_cli.runtime.loading import create_engine, load_tokenizer, load_weights

weights = load_weights(sys.argv[1] if len(sys.argv) > 1 else "random:tiny")
tok, engine = load_tokenizer(weights), create_engine(weights)
questions = ["What is the capital of France?", "Write a haiku about GPUs."]
prompts = [render_prompt(tok, [Message("user", q)], SystemConfig(reasoning_effort="low")) for q in questions]
for question, out in zip(questions, engine.generate(prompts, SamplingParams(max_tokens=48, seed=0))):
    t = out.timings
    print(f"> {question}  [{len(out.token_ids)} tokens, {out.finish_reason}, "
          f"{len(out.token_ids) / (t.finished - t.first_token + 1e-9):.0f} tok/s]")
    messages = parse_completion(tok, out.token_ids)
    print("\n".join(f"  [{m.channel}] {m.content}" for m in messages) or "  " + tok.decode(out.token_ids)[:200])
