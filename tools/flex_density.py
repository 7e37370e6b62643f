"""How much of the drafter's flex attention is masked-out work: on one training batch of real records,
the key-tile area flex visits (partial + full tiles, per tile shape) against the (query, key) pairs the
DFlash rule lets attend. CPU only: builds the layout and the BlockMask, runs no kernel.

    python tools/flex_density.py --records DIR/synth.jsonl --tokenizer MODEL_DIR [--anchors 96 --budget 65536 --max-docs 256]

The batch: records in a seeded random order, packed until the token budget or the document cap is hit
(the data plan's rule for one length bucket, roughly); the prompt unsupervised, the answer supervised.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from dflash_ipc.drafter import blocks as B
from dflash_ipc.drafter.masks import flex_block_mask, mask_values

TILES = (128, 64, (128, 64), (64, 128))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--anchors", type=int, default=96)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--budget", type=int, default=65536)
    ap.add_argument("--max-docs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    with open(args.records) as f:
        recs = [json.loads(line) for line in f]
    random.Random(args.seed).shuffle(recs)
    seq, masks, total = [], [], 0
    for r in recs:
        conv = r["conversations"]
        prompt = len(tok(tok.apply_chat_template([conv[0]], tokenize=False, add_generation_prompt=True))["input_ids"])
        answer = len(tok(conv[1]["content"])["input_ids"]) + 2  # + the turn's end
        if total + prompt + answer > args.budget or len(seq) >= args.max_docs:
            break
        seq.append(prompt + answer)
        masks.append(torch.cat([torch.zeros(prompt, dtype=torch.uint8), torch.ones(answer, dtype=torch.uint8)]))
        total += prompt + answer
    lens, lm = torch.tensor(seq), torch.cat(masks)
    n = int(lens.sum())
    anchors, adoc = B.sample_anchors(lm, lens, args.anchors, args.block, torch.Generator().manual_seed(args.seed))
    doc = B.document_index(lens, n)
    lab = B.block_labels(torch.zeros(n, dtype=torch.long), lm, anchors, doc.doc_end[adoc], args.block, 4.0)
    layout = B.build_block_layout(lens, anchors, adoc, args.block, lab.valid.any(1), n=n)
    kv = torch.arange(layout.kv_len)[None, :]
    visible = 0
    for s in range(0, layout.num_queries, 2048):
        q = torch.arange(s, min(s + 2048, layout.num_queries))[:, None]
        visible += int(mask_values(layout.index, q, kv, causal=False, window=None).sum())
    out = {"documents": len(seq), "tokens": n, "queries": layout.num_queries, "visible_per_query": visible / layout.num_queries}
    for tile in TILES:
        qb, kb = (tile, tile) if isinstance(tile, int) else tile
        bm = flex_block_mask(layout, "full_attention", 2048, tile)
        partial, full = int(bm.kv_num_blocks.sum()), int(bm.full_kv_num_blocks.sum())
        out[f"tile {qb}x{kb}"] = {"partial": partial, "full": full, "area_over_visible": round((partial + full) * qb * kb / visible, 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
