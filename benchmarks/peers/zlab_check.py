"""Does z-lab's reference decoder (PyPI ``dflash`` 0.1.0) load and decode a dflash-ipc export?

    python zlab_check.py --target TARGET_DIR --drafter EXPORT_DIR [--max-new 48] [--prompts 3] [--ctx 40]

1. loads the export with ``dflash.model.DFlashDraftModel.from_pretrained`` (missing / unexpected keys);
2. compares one draft block's logits, z-lab's drafter against dflash-ipc's own (``load_exported_drafter`` +
   ``eval.spec.DrafterProposer``), on the same target features, anchor and positions (fp32);
3. decodes with z-lab's ``dflash_generate`` (greedy) and with dflash-ipc's ``speculative_generate``: both
   must equal plain greedy decoding, and the per-step acceptance lengths of the two decoders are compared.

Prints one JSON line. CPU is enough (z-lab's stats timer calls torch.cuda.synchronize: patched on CPU).
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--ctx", type=int, default=40, help="prompt length (random ids)")
    p.add_argument("--prompts-jsonl", default="", help="chat records: their first user turns, rendered by --tokenizer's chat template")
    p.add_argument("--tokenizer", default="builtin", help='"builtin" (dflash-ipc\'s) or a tokenizer folder')
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    import dflash.model as zl
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_ipc.drafter.export.layout import load_exported_drafter
    from dflash_ipc.eval.spec import DrafterProposer, greedy_generate, speculative_generate
    from dflash_ipc.eval.target_lm import TargetLM

    dev = torch.device(args.device)
    if dev.type != "cuda":
        zl._cuda_time = time.perf_counter  # z-lab times with torch.cuda.synchronize(); none on a CPU
    torch.manual_seed(0)
    res: dict = {"target": args.target, "drafter": args.drafter}

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32, attn_implementation="sdpa").to(dev).eval()
    draft, info = zl.DFlashDraftModel.from_pretrained(
        args.drafter, dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True
    )
    draft = draft.to(dev).eval()
    res["zlab_load"] = {k: sorted(v) if isinstance(v, (list, set)) else v for k, v in info.items() if v}
    res["zlab_view"] = {
        "block_size": draft.block_size,
        "mask_token_id": draft.mask_token_id,
        "target_layer_ids": list(draft.target_layer_ids),
        "layers": [{"causal": layer.self_attn.is_causal, "sliding_window": layer.self_attn.sliding_window} for layer in draft.layers],
    }

    emb = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    ipc = load_exported_drafter(args.drafter, emb, head, attention="sdpa", device=dev).float().eval()
    res["ipc_view"] = {"layer_types": list(ipc.config.layer_types), "sliding_window": ipc.config.sliding_window}
    tlm = TargetLM(target, list(ipc.config.target_layer_ids))
    vocab = int(target.config.vocab_size)
    B = draft.block_size

    # ---- one block's logits, both drafters, same inputs
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(8, min(vocab, 1000), (args.ctx,), generator=gen).tolist()
    feats_ipc = tlm.forward(prompt, tlm.new_cache())[1]  # [n, k*H]
    with torch.no_grad():
        out = target(torch.tensor([prompt], device=dev), output_hidden_states=True, use_cache=False)
        feats_z = zl.extract_context_feature(out.hidden_states, draft.target_layer_ids)  # [1, n, k*H]
        anchor = int(out.logits[0, -1].argmax())
        logits_ipc = DrafterProposer(ipc).logits(feats_ipc, anchor, B - 1).float()
        ids = torch.full((1, B), draft.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = anchor
        noise = zl._raw_input_embeddings(target, ids)
        n = feats_z.shape[1]
        h = draft(target_hidden=feats_z, noise_embedding=noise, position_ids=torch.arange(n + B, device=dev)[None])
        logits_z = draft.compute_logits(h[:, 1:], zl._output_head(target))[0].float()
    res["features_max_abs_diff"] = float((feats_ipc.float() - feats_z[0].float()).abs().max())
    res["block_logits_max_abs_diff"] = float((logits_ipc - logits_z).abs().max())
    res["block_argmax_agree"] = f"{int((logits_ipc.argmax(-1) == logits_z.argmax(-1)).sum())}/{B - 1}"

    # ---- decoding: z-lab vs dflash-ipc vs plain greedy
    prompts = [torch.randint(8, min(vocab, 1000), (args.ctx,), generator=gen).tolist() for _ in range(args.prompts)]
    if args.prompts_jsonl:
        from dflash_ipc.data.tokenizer import load_tokenizer

        tok = load_tokenizer(args.tokenizer)
        with open(args.prompts_jsonl) as f:
            recs = [json.loads(x) for x in f if x.strip()][: args.prompts]
        prompts = [
            list(tok.apply_chat_template([r["conversations"][0]], add_generation_prompt=True, tokenize=True, return_dict=False))
            for r in recs
        ]
    runs = []
    for pr in prompts:
        plain = greedy_generate(tlm, pr, args.max_new, set()).tokens
        spec_ipc = speculative_generate(tlm, DrafterProposer(ipc), pr, args.max_new, set(), B)
        z = zl.dflash_generate(draft, target, torch.tensor([pr], device=dev), args.max_new, None, temperature=0.0, return_stats=True)
        z_tokens = z.output_ids[0, len(pr) :].tolist()
        runs.append(
            {
                "zlab_equals_greedy": z_tokens == plain[: len(z_tokens)] and len(z_tokens) == len(plain),
                "ipc_equals_greedy": spec_ipc.tokens == plain,
                "zlab_tokens": len(z_tokens),
                "ipc_tokens": len(spec_ipc.tokens),
                "zlab_acceptance": z.acceptance_lengths,
                "ipc_acceptance": [len(s.tokens) for s in spec_ipc.steps],
            }
        )
    res["decode"] = runs
    res["acceptance_identical"] = all(r["zlab_acceptance"] == r["ipc_acceptance"] for r in runs)
    res["all_lossless"] = all(r["zlab_equals_greedy"] and r["ipc_equals_greedy"] for r in runs)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
