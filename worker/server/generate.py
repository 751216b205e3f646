"""Command line: `python -m worker.server.generate "What is the capital of France?"` prints the model's chat
answer.

Loads a model, applies its chat template, runs the engine to completion and prints the decoded answer.
"""

from __future__ import annotations

import argparse
import sys

from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.model.loader import load_model
from worker.protocol import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.server.generate", description=__doc__.splitlines()[0])
    ap.add_argument("prompt")
    ap.add_argument("--model", default="default", help="'default', a .gguf file or a local HF folder")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--system", default=None, help="system message (default: the template's own)")
    ap.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    tok = loaded.tokenizer
    if args.raw:
        ids = tok.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        ids = tok.apply_chat_template(messages)
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=256 << 20))
    params = SamplingParams(max_tokens=min(args.max_tokens, loaded.max_context - len(ids)),
                            temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    out = engine.generate([ids], params)[0]
    print(tok.decode(out).strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
