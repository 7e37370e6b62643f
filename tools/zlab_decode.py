"""z-lab's reference decoder (PyPI ``dflash`` 0.1.0) on a dflash-ipc export and the real target: τ and losslessness.

    python tools/zlab_decode.py --config TRAIN.toml --drafter EXPORT --prompts configs/eval/everyday.jsonl \
        --n 50 --max-new 128 --device cuda:0 [--route automodel|zlab]

The prompts are eval's (``load_prompts``: the config's tokenizer and chat template), so the printed τ
compares with ``dflash-ipc eval --config TRAIN.toml --drafter EXPORT --prompts SAME --n N --max-new M``.
``--route zlab``: z-lab's ``DFlashDraftModel`` (the target's whole head); ``automodel``: the export's own
modeling code through ``AutoModel.from_pretrained(EXPORT, trust_remote_code=True)`` (its own head rows
when it has them). z-lab's loop runs with a block more budget and is counted up to ``--max-new`` tokens:
it drafts a shorter block where the budget ends inside one, eval a whole one (cut), and full layers see
the whole block. fp32 by default (``--dtype bfloat16`` for speed; then ties may differ). Prints one JSON line.

z-lab's loop rolls the target's cache back by cropping it (past sliding windows too: it records the past and
crops after every forward). ``target_crops_exactly`` false: the target has layers a crop cannot roll back
(recurrent state: Qwen3.5's and Qwen3-Next's GatedDeltaNet), so z-lab's outputs leave greedy decoding's after a
rejection (``lossless`` false) while eval and the export's own ``spec_generate`` re-run the kept tokens instead.
On Gemma 3n z-lab's context reads the layers' stacked AltUp streams and fails.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", default=None, help="eval's --prompts (default: the config's data.paths)")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--route", choices=("automodel", "zlab"), default="automodel")
    args = p.parse_args(argv)
    from dflash_ipc.platform.third_party_logs import quiet_import_notes

    quiet_import_notes()  # transformers imports torchao with the models: its notes are noise here
    import dflash.model as zl
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from dflash_ipc.config import load_config
    from dflash_ipc.data.tokenizer import config_tokenizer, stop_token_ids
    from dflash_ipc.drafter.export.hf_modeling import crops_exactly, rollback_cache
    from dflash_ipc.eval.run import load_prompts
    from dflash_ipc.families import family_of

    cfg = load_config(args.config)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if dev.type != "cuda":
        zl._cuda_time = time.perf_counter  # z-lab times with torch.cuda.synchronize()
    tok = config_tokenizer(cfg)
    prompts, stops = load_prompts(cfg, tok, args.prompts, args.n), sorted(stop_token_ids(tok))
    hf_config = AutoConfig.from_pretrained(cfg.target.model_path)
    attention = family_of(hf_config).attention_implementation(cfg.target.attn_implementation)  # as eval loads it
    target = AutoModelForCausalLM.from_pretrained(cfg.target.model_path, dtype=dtype, attn_implementation=attention).to(dev).eval()
    if args.route == "zlab":
        draft = zl.DFlashDraftModel.from_pretrained(args.drafter, dtype=dtype)
    else:
        draft = AutoModel.from_pretrained(args.drafter, trust_remote_code=True, dtype=dtype)
    draft = draft.to(dev).eval()
    lengths, lossless, t0 = [], [], time.perf_counter()
    for pr in prompts:
        ids = torch.tensor([pr], device=dev)
        z = zl.dflash_generate(draft, target, ids, args.max_new + draft.block_size, stops, temperature=0.0, return_stats=True)
        out = z.output_ids[0, len(pr) :].tolist()[: args.max_new]
        greedy = target.generate(ids, max_new_tokens=args.max_new, do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
        lossless.append(out == greedy[0, len(pr) :].tolist())
        left = len(out) - 1
        for n in z.acceptance_lengths:
            if left <= 0:
                break
            lengths.append(min(n, left))
            left -= n
    res = {
        "route": args.route,
        "class": type(draft).__name__,
        "prompts": len(prompts),
        "tau": round(sum(lengths) / len(lengths), 4) if lengths else 0.0,
        "verify_steps": len(lengths),
        "lossless": all(lossless),
        "target_crops_exactly": crops_exactly(rollback_cache(hf_config)),
        "mismatched_prompts": [i for i, ok in enumerate(lossless) if not ok],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
