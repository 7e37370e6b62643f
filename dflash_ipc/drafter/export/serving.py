"""The commands that serve an exported drafter, per engine, written for the target they serve it with.

    the run's config ──▶ ServingTarget: how an engine names the target (an absolute path, a hub id as given,
                         or TARGET for a random spec), its family (hybrid: linear-attention / Mamba layers),
                         its tokenizer, eval's stop tokens
    export dir + the drafter's config + ServingTarget + --for ──▶ one command (or Python lines) per engine:

      vllm        vllm serve TARGET --speculative-config '{"method": "dflash", ...}'
      sglang      python -m sglang.launch_server ... --speculative-algorithm DFLASH ...
                  (+ --mamba-scheduler-strategy extra_buffer for a hybrid target)
      zlab        z-lab's own DFlashDraftModel and decoding loop (PyPI ``dflash``)
      automodel   AutoModel.from_pretrained(EXPORT, trust_remote_code=True): the export's own modeling code
      speculators speculators convert EXPORT --algorithm dflash --verifier TARGET (the layouts it converts)

The Python routes load target and drafter in one dtype (a bf16 target beside an fp32 drafter fails in the first
matmul), render the prompt as eval does and stop at eval's stop tokens, and print τ as eval counts it (tokens per
verification step). Rendering is pure (:func:`render_serving_commands`); :func:`serving_target` reads the target.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from dflash_ipc.drafter.export.layout import carries_reduced_head
from dflash_ipc.drafter.model.dflash_drafter import FULL, SLIDING, DrafterModelConfig

#: the engine versions whose DFlash loaders the export layout was written against (drafter/export/layout.py)
SUPPORTED = {
    "vllm": "vLLM 0.33",
    "sglang": "SGLang 0.5.23",
    "zlab": "z-lab dflash 0.1.0",
    "automodel": "transformers AutoModel",
    "speculators": "speculators 0.9.0",
}
#: the engines that read each export layout (``--for``)
ENGINES_BY_CLIENT = {
    "all": ("vllm", "sglang", "zlab", "automodel", "speculators"),
    "vllm": ("vllm",),
    "sglang": ("sglang", "zlab", "speculators"),
    "zlab": ("zlab", "automodel"),
}
#: the target placeholder of a run whose target is a random spec (no checkpoint to serve)
TARGET_PLACEHOLDER = "TARGET"
#: the prompt and length the Python routes decode (a test substitutes these two lines)
EXAMPLE_MESSAGES_LINE = "messages = [{'role': 'user', 'content': 'Explain speculative decoding in two sentences.'}]"
EXAMPLE_MAX_NEW_LINE = "max_new_tokens = 256"


@dataclass(frozen=True)
class ServingTarget:
    """The target as the serving commands name and load it."""

    name: str  # an absolute checkpoint path, a hub id as given, or TARGET_PLACEHOLDER
    tokenizer: str  # an absolute tokenizer path or hub id; "builtin": dflash-ipc's own tokenizer
    hybrid: bool  # linear-attention / Mamba layers beside attention (Qwen3.5's GatedDeltaNet, Qwen3-Next, NemotronH)
    stop_token_ids: tuple[int, ...]  # eval's: the tokenizer's end-of-turn ids and the model's generation-config eos
    chat_template_kwargs: dict


def engine_reference(path: str) -> str:
    """``path`` as a serving engine must be given it, resolved as the loaders resolve it (transformers' own
    ``from_pretrained``, from the working directory): an existing directory becomes absolute, so the command
    works from any directory; anything else (a hub id) is left as it is."""
    if not path:
        return TARGET_PLACEHOLDER
    local = Path(path).expanduser()
    return str(local.resolve()) if local.is_dir() else path


def serving_target(cfg) -> ServingTarget:
    """The run's target as the serving commands name it (reads its config, tokenizer and generation config)."""
    from dflash_ipc.data.tokenizer import BUILTIN_SPEC, config_tokenizer, stop_token_ids
    from dflash_ipc.families import family_of
    from dflash_ipc.target_spec.hf_config import load_hf_config

    tok = config_tokenizer(cfg)  # with the target's generation-config eos ids bound: what from_pretrained gives eval's target
    hf_config = load_hf_config(cfg.target, vocab_size=len(tok))
    path = cfg.target.model_path
    spec = cfg.target.tokenizer
    return ServingTarget(
        name=engine_reference(path),
        tokenizer=spec if spec == BUILTIN_SPEC else engine_reference(spec),
        hybrid=family_of(hf_config).has_recurrent_layers(),
        stop_token_ids=tuple(sorted(stop_token_ids(tok))),
        chat_template_kwargs=dict(cfg.chat_template.kwargs),
    )


def speculators_note(config: DrafterModelConfig, client: str) -> str | None:
    """Why speculators cannot convert this export, or None when it can."""
    if "speculators" not in ENGINES_BY_CLIENT[client] or not carries_reduced_head(config, client):
        return None
    return (
        f"speculators 0.9.0 cannot convert this export: its converter sizes lm_head to the target's whole vocabulary "
        f"({config.vocab_size} rows) and this export's head holds the {config.draft_vocab_size} rows of "
        "drafter.draft_vocab_size; export with --for sglang (the target's whole head) for speculators"
    )


def render_serving_commands(out: Path, config: DrafterModelConfig, target: ServingTarget, client: str = "all") -> dict[str, str]:
    """The command (the Python routes: their lines) that serves export ``out`` with ``target``, per engine of ``client``."""
    drafter = str(Path(out).resolve())
    render = {"vllm": _vllm, "sglang": _sglang, "zlab": _zlab, "automodel": _automodel, "speculators": _speculators}
    return {engine: render[engine](drafter, config, target, client) for engine in ENGINES_BY_CLIENT[client]}


def _head_text(config: DrafterModelConfig, client: str) -> str:
    return "its own head rows (lm_head + d2t)" if carries_reduced_head(config, client) else "the target's whole head"


def _vllm(drafter: str, config: DrafterModelConfig, target: ServingTarget, client: str) -> str:
    spec = json.dumps({"method": "dflash", "model": drafter, "num_speculative_tokens": config.block_size - 1})
    mixed = SLIDING in config.layer_types and FULL in config.layer_types  # vLLM's V1 runner reads one attention kind
    line = f"{'VLLM_USE_V2_MODEL_RUNNER=1 ' if mixed else ''}vllm serve {shlex.quote(target.name)} --speculative-config {shlex.quote(spec)}"
    if target.chat_template_kwargs:
        line += f" --default-chat-template-kwargs {shlex.quote(json.dumps(target.chat_template_kwargs))}"
    return f"# {SUPPORTED['vllm']}; drafts over {_head_text(config, client)}\n{line}"


def _sglang(drafter: str, config: DrafterModelConfig, target: ServingTarget, client: str) -> str:
    line = (
        f"python -m sglang.launch_server --model-path {shlex.quote(target.name)} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {shlex.quote(drafter)} --speculative-num-draft-tokens {config.block_size}"
    )
    note = f"# {SUPPORTED['sglang']}; drafts over the target's whole head"
    if target.hybrid:
        # SGLang refuses speculative decoding on a Mamba-hybrid target with its radix cache under the default
        # no_buffer strategy; extra_buffer keeps a ping-pong copy of the recurrent state per request
        line += " --mamba-scheduler-strategy extra_buffer"
        note += "; a hybrid target (linear-attention layers): --mamba-scheduler-strategy extra_buffer"
    if target.chat_template_kwargs:
        note += f'; send "chat_template_kwargs": {json.dumps(target.chat_template_kwargs)} with each chat request (as trained)'
    return f"{note}\n{line}"


def _python_route(head: str, load_draft: list[str], decode: list[str], target: ServingTarget) -> str:
    """The lines both Python routes share: the models in one dtype, eval's prompt rendering and stop tokens."""
    from dflash_ipc.data.tokenizer import BUILTIN_SPEC

    if target.tokenizer == BUILTIN_SPEC:
        tokenizer = ["from dflash_ipc.data.tokenizer import build_builtin_tokenizer", "tok = build_builtin_tokenizer()"]
    else:
        tokenizer = [f"tok = AutoTokenizer.from_pretrained({target.tokenizer!r})"]
    kwargs = "".join(f", {k}={v!r}" for k, v in target.chat_template_kwargs.items())
    return "\n".join(
        [
            head,
            "import torch",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "device = 'cuda' if torch.cuda.is_available() else 'cpu'",
            "dtype = torch.float32  # one dtype for target and drafter (bfloat16 on a GPU for speed; float32 decodes as eval)",
            f"target = AutoModelForCausalLM.from_pretrained({target.name!r}, dtype=dtype).to(device).eval()",
            *load_draft,
            *tokenizer,
            f"stop_token_ids = {list(target.stop_token_ids)}  # eval's: end of turn, end of text, the model's eos",
            EXAMPLE_MESSAGES_LINE,
            EXAMPLE_MAX_NEW_LINE,
            f"text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True{kwargs})",
            "input_ids = tok(text, add_special_tokens=False, return_tensors='pt').input_ids.to(device)",
            *decode,
            "print(tok.decode(output_ids[0, input_ids.shape[1]:]))",
            "print('tau', round(sum(steps) / max(1, len(steps)), 4))  # tokens per verification step, as `dflash-ipc eval` counts",
        ]
    )


def _zlab(drafter: str, config: DrafterModelConfig, target: ServingTarget, client: str) -> str:
    del config, client  # z-lab's class skips the reduced head: it always drafts over the target's whole head
    return _python_route(
        f"# {SUPPORTED['zlab']}: its own DFlashDraftModel and decoding loop; drafts over the target's whole head",
        [
            "import dflash.model",
            "from dflash.model import DFlashDraftModel, dflash_generate",
            "if device == 'cpu':  # z-lab's loop times its steps with torch.cuda.synchronize(), which a CPU cannot run",
            "    import time",
            "    dflash.model._cuda_time = time.perf_counter",
            f"draft = DFlashDraftModel.from_pretrained({drafter!r}, dtype=dtype).to(device).eval()",
        ],
        [
            "# z-lab's loop drafts a shorter block where max_new_tokens ends inside one; a block more lets it draft whole",
            "# blocks as eval does, and the output and its steps are cut at max_new_tokens",
            "out = dflash_generate(draft, target, input_ids, max_new_tokens + draft.block_size, stop_token_ids, return_stats=True)",
            "output_ids = out.output_ids[:, : input_ids.shape[1] + max_new_tokens]",
            "steps, left = [], output_ids.shape[1] - input_ids.shape[1] - 1  # the first new token comes from the prefill",
            "for accepted in out.acceptance_lengths[: max(0, left)]:",
            "    steps, left = steps + [min(accepted, left)], left - accepted",
            "    if left <= 0:",
            "        break",
        ],
        target,
    )


def _automodel(drafter: str, config: DrafterModelConfig, target: ServingTarget, client: str) -> str:
    return _python_route(
        f"# {SUPPORTED['automodel']}: the export's own modeling code (trust_remote_code); drafts over {_head_text(config, client)}",
        [
            "from transformers import AutoModel",
            f"draft = AutoModel.from_pretrained({drafter!r}, trust_remote_code=True, dtype=dtype).to(device).eval()",
        ],
        [
            "output_ids = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=max_new_tokens, "
            "stop_token_ids=stop_token_ids)",
            "steps = draft.acceptance_lengths",
        ],
        target,
    )


def _speculators(drafter: str, config: DrafterModelConfig, target: ServingTarget, client: str) -> str:
    note = speculators_note(config, client)
    if note is not None:
        return f"# {note}"
    converted = shlex.quote(f"{drafter}-speculators")
    return (
        f"# {SUPPORTED['speculators']} converts this layout (the target's whole head) for its own training and vLLM\n"
        f"speculators convert {shlex.quote(drafter)} --algorithm dflash --verifier {shlex.quote(target.name)} --output-path {converted}"
    )
