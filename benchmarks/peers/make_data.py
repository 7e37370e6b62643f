"""Random-token training records for dflash-ipc: each chat's assistant turn carries ``token_ids``
(gen-data's field, used verbatim) of random ids after a one-line prompt.

``--lengths fixed``: ``--len`` answer ids each, so every document is cut to data.max_seq_len tokens, as the
SpecForge bench's fixed-length random sequences. ``--lengths mixed``: each document's length drawn from
shapes.doc_lengths's log-normal (the same draw the SpecForge bench takes with ``--lengths mixed``), capped
at ``--seq-len``.

    python make_data.py --out data.jsonl --n 400 --len 2100
    python make_data.py --out mixed.jsonl --n 2000 --lengths mixed --seq-len 2048
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import doc_lengths  # noqa: E402

#: tokens the chat template puts around the answer (the prompt line and the role markers), left out of a mixed length
PROMPT_TOKENS = 10


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--len", type=int, default=2100, help="answer ids per record (--lengths fixed)")
    p.add_argument("--lengths", choices=["fixed", "mixed"], default="fixed")
    p.add_argument("--seq-len", type=int, default=2048, help="the longest document (--lengths mixed)")
    p.add_argument("--high", type=int, default=1000, help="ids drawn below this (builtin tokenizer: 1024 ids, specials at 1020-1023)")
    p.add_argument("--low", type=int, default=8, help="lowest id used (keeps clear of the special tokens)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    if args.lengths == "fixed":
        answers = [args.len] * args.n
    else:
        answers = [max(1, n - PROMPT_TOKENS) for n in doc_lengths(args.n, args.seq_len, "mixed", args.seed)]
    with open(args.out, "w") as f:
        for i, n in enumerate(answers):
            ids = [rng.randrange(args.low, args.high) for _ in range(n)]
            rec = {
                "conversations": [
                    {"role": "user", "content": f"record {i}"},
                    {"role": "assistant", "content": "x", "token_ids": ids},
                ]
            }
            f.write(json.dumps(rec) + "\n")
    print(f"[make_data] {args.n} records ({args.lengths}, {sum(answers):,} answer ids) -> {args.out}")


if __name__ == "__main__":
    main()
