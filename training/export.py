"""Export a dense run as a Hugging Face ``LlamaForCausalLM``, with its tokenizer and a model card.

``training.model`` is Llama's architecture: RMSNorm before attention and
feed-forward, SwiGLU, no biases, untied embeddings, RoPE on every head. Two
things differ only in layout:

- RoPE pairs: ours rotates interleaved pairs ``(x[2i], x[2i+1])`` (Meta's
  original code); transformers rotates the two halves ``(x[i], x[i + d/2])``.
  Permuting the output rows of ``wq`` and ``wk`` within each head maps one onto
  the other, exactly as transformers' ``convert_llama_weights_to_hf.py`` does.
- Names: ``layers.{i}.attention.wq`` → ``model.layers.{i}.self_attn.q_proj``…

What cannot be exported, because no transformers class computes it:
- ``attention: sparse`` (training.attention's causal block selection): a Llama
  would attend densely and give other logits;
- ``ffn: moe``: our router is DeepSeek-V3's (sigmoid scores, bias-adjusted
  top-k selection, gates renormalised over the chosen experts) inside plain
  multi-head attention. transformers' DeepseekV3 has that router but needs
  multi-head latent attention; Mixtral and Qwen2-MoE route by softmax. None
  reproduces the logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from assay.errors import AssayError
from assay.output_lock import exclusive_output
from assay.shards import publish_directory, staging_dir
from assay.staging import require_folder_or_absent, require_not_dangling
from training.checkpoint import CHECKPOINTS, LATEST, broken_latest, latest_checkpoint, load_state, read_trainer_state
from training.model import ModelArgs, Transformer
from training.tokenizer import EOS, PAD, load_tokenizer

__all__ = ["export_run", "interleaved_to_half", "llama_state_dict", "load_run_model"]

METRICS_FILE = "metrics.json"


def interleaved_to_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q/k projection from interleaved RoPE pairs to rotate-half.

    Within each head, rows ``0, 2, 4…`` (the pairs' first halves) go first, then ``1, 3, 5…``:
    transformers' ``permute(w, n_heads, dim1, dim2)``.
    """
    out_dim, in_dim = weight.shape
    head_dim = out_dim // n_heads
    return weight.view(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def refusal(args: dict) -> str | None:
    """Why a run with these model args cannot be a LlamaForCausalLM, or None when it can."""
    if args.get("attention", "dense") != "dense":
        return ("sparse attention cannot be exported: no transformers model computes its causal block "
                "selection, and a Llama would attend densely and give other logits")
    if args.get("ffn", "dense") != "dense":
        return ("MoE cannot be exported: its DeepSeek-V3 router (sigmoid, bias-adjusted top-k) sits in plain "
                "multi-head attention, which transformers' DeepseekV3 (latent attention) does not have, and "
                "Mixtral / Qwen2-MoE route by softmax; none reproduces the logits")
    return None


def load_run_model(run_dir: str | Path, checkpoint: str | Path | None = None) -> tuple[Transformer, dict]:
    """Our model with the weights of ``checkpoint`` (default: the run's latest), on CPU, in eval mode.

    Only the model's tensors are read from the DCP checkpoint; the optimizer state stays on disk.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise AssayError(f"{run}: no such run directory")
    checkpoint = Path(checkpoint) if checkpoint else latest_checkpoint(run)
    if checkpoint is None:
        broken = broken_latest(run)
        raise AssayError(f"{broken}; write the name of the one to export into {run / CHECKPOINTS / LATEST}" if broken
                         else f"{run} holds no finished checkpoint (checkpoints/latest); train it first")
    trainer = read_trainer_state(checkpoint)
    why_not = refusal(trainer["model_args"])
    if why_not:
        raise AssayError(f"{run}: {why_not}")
    tokenizer = load_tokenizer(run)
    args = ModelArgs(vocab_size=tokenizer.get_vocab_size(), max_seq_len=trainer["seq_len"], **trainer["model_args"])
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)  # fills the RoPE buffers; every parameter is then overwritten by the load
    state = {"model": model.state_dict()}
    load_state(state, checkpoint)  # in place, into the model's tensors
    model.eval()
    return model, trainer


def llama_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our parameters under LlamaForCausalLM's names, q/k permuted to rotate-half."""
    heads = model.args.n_heads
    names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    out = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight,
           "lm_head.weight": model.output.weight}
    for index, layer in model.layers.items():
        for ours, theirs in names.items():
            module = layer.get_submodule(ours)
            weight = module.weight
            if ours in ("attention.wq", "attention.wk"):
                weight = interleaved_to_half(weight, heads)
            out[f"model.layers.{index}.{theirs}.weight"] = weight
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def _llama_config(model: Transformer, tokenizer, extra: dict[str, Any]):
    from transformers import LlamaConfig

    args = model.args
    eos, pad = tokenizer.token_to_id(EOS), tokenizer.token_to_id(PAD)
    return LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_hidden,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads,
        head_dim=args.head_dim, max_position_embeddings=args.max_seq_len, rms_norm_eps=args.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta}, hidden_act="silu",
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        # Documents were trained as text followed by EOS, with no BOS: EOS is also what separates them.
        bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, dtype="float32", **extra,
    )


def _hf_tokenizer(tokenizer, seq_len: int):
    from transformers import PreTrainedTokenizerFast

    # No post-processor: like training, encoding adds no special tokens.
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=seq_len, clean_up_tokenization_spaces=False)


def _is_export(folder: Path) -> bool:
    try:
        return "assay" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def _check_out(run: Path, out: Path, overwrite: bool) -> None:
    """Refuse an --out whose replacement would delete what it must not: the run itself (or a folder
    holding it), the current directory (or one holding it), a file, or any folder that is not an
    earlier export (`--out . --overwrite` would otherwise delete the repository). A symlink to a
    folder is followed: the export goes where it points."""
    require_not_dangling(out)
    require_folder_or_absent(out)
    if out.resolve() == run.resolve() or run.resolve().is_relative_to(out.resolve()):
        raise AssayError(f"{out}: is or holds the run {run}, which writing the export there would delete; "
                         "choose another --out")
    if Path.cwd().resolve().is_relative_to(out.resolve()):
        raise AssayError(f"{out}: is or holds the current directory, which the export would replace; "
                         "choose another --out, such as a new folder's name")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise AssayError(f"{out} is not empty; pass --overwrite to replace it")
        if not _is_export(out):
            raise AssayError(f"{out}: holds something other than an Assay export (no config.json of one); "
                             "--overwrite replaces only an earlier export: choose another --out")


def export_run(run_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False,
               checkpoint: str | Path | None = None) -> dict[str, Any]:
    """Write the run's latest checkpoint to ``out_dir`` as a Hugging Face model (see module docstring).
    A second export into ``out_dir`` while one writes it is refused (`assay.output_lock`): it would
    clear the first one's staging folder."""
    with exclusive_output(out_dir):
        return _export(Path(run_dir), Path(out_dir), overwrite, checkpoint)


def _export(run: Path, out: Path, overwrite: bool, checkpoint: str | Path | None) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    _check_out(run, out, overwrite)
    model, trainer = load_run_model(run, checkpoint)
    tokenizer = load_tokenizer(run)
    metrics = json.loads((run / METRICS_FILE).read_text()) if (run / METRICS_FILE).exists() else {}
    # The checkpoint's own record of its data, which metrics.json repeats once the run has finished.
    data = trainer.get("data") or metrics.get("data") or {}
    provenance = {"run": str(run), "step": trainer["step"], "data": data,
                  "config_fingerprint": trainer.get("config_fingerprint")}
    config = _llama_config(model, tokenizer, {"assay": provenance})
    with torch.device("cpu"):
        hf = LlamaForCausalLM(config)
    missing, unexpected = hf.load_state_dict(llama_state_dict(model), strict=False)
    # Rotary inv_freq is a non-persistent buffer that transformers computes itself.
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise AssayError(f"internal: Llama names do not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
    hf.eval()
    # Written in .NAME.staging beside where --out points (through a link), then swapped in whole: an
    # earlier export stays intact until the new one is complete. A failed write removes the staging
    # folder; a killed one leaves it, and the next export clears it.
    staging = staging_dir(out)
    shutil.rmtree(staging, ignore_errors=True)
    built = staging / "export"
    try:
        built.mkdir(parents=True)
        hf.save_pretrained(built)
        _hf_tokenizer(tokenizer, model.args.max_seq_len).save_pretrained(built)
        # transformers 5 names its fast-tokenizer class TokenizersBackend, which 4.x cannot resolve;
        # both resolve PreTrainedTokenizerFast, so the export loads in either.
        tok_config = built / "tokenizer_config.json"
        tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()),
                                          "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
        (built / "README.md").write_text(model_card(model, trainer, metrics, provenance))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_directory(built, out, staging / "previous")
    shutil.rmtree(staging)
    return {"run": str(run), "out": str(out), "step": trainer["step"], "data": data, "finished": bool(metrics),
            "parameters": sum(p.numel() for p in model.parameters()), "files": sorted(p.name for p in out.iterdir())}


def _hash_kind(data: dict) -> str:
    if data.get("tracked"):
        return "DVC-tracked"
    if data.get("modified_since_dvc"):
        return "Assay's digest of the workspace's bytes, which differ from what DVC recorded"
    return "untracked directory"


def _reproduce(data: dict) -> str:
    """How to get the data back; a commit is named only where its dvc.lock or .dvc file records these bytes."""
    if data.get("commit_records_data") is False:
        why = ("untracked data: no commit records it" if not data.get("tracked") and not data.get("modified_since_dvc")
               else "the workspace held other bytes than DVC recorded" if data.get("modified_since_dvc")
               else "DVC recorded it after that commit (dvc.lock or the .dvc file was not committed yet)")
        commit = f"Commit `{data['commit']}`" if data.get("commit") else "No commit (not in a git repository)"
        return (f"{commit} does not hold this data ({why}); only the hash above names it. "
                "Track it with DVC and commit its record to make it a version others can check out.")
    return ("Reproduce the data: `git checkout <commit> && dvc pull`, or read it in place with "
            f"`assay train --data {data.get('path')} --rev <commit>`.")


def _software(made_by: dict | None) -> str:
    if not isinstance(made_by, dict):
        return "trained by an Assay that did not record its installation"
    packages = made_by.get("packages") or {}
    return (f"trained with Assay {made_by.get('assay')} (source digest `{made_by.get('code')}`) on Python "
            f"{made_by.get('python')}" + "".join(f", {name} {packages[name]}" for name in ("torch", "tokenizers")
                                                 if name in packages))


def model_card(model: Transformer, trainer: dict, metrics: dict, provenance: dict) -> str:
    args, data = model.args, provenance["data"]
    version = data.get("rev") or "the workspace (no --rev)"
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation", "tags: [assay, llama]", "---", "",
        "# Assay decoder LM", "",
        f"Trained by Assay (`assay train`), step {trainer['step']} of run `{provenance['run']}`, exported with "
        "`assay export` as a `LlamaForCausalLM` (weights unchanged; q/k rows reordered from interleaved RoPE "
        "to rotate-half).", "",
        "## Dataset version", "",
        f"- path: `{data.get('path')}`",
        f"- rev: `{version}`" + (f", commit `{data['commit']}`" if data.get("commit") else ", no git commit"),
        f"- DVC hash: `{data.get('data_hash')}` ({_hash_kind(data)})",
        "", _reproduce(data), "",
        "## Architecture", "",
        f"{args.n_layers} layer{'s' if args.n_layers != 1 else ''}, hidden {args.dim}, {args.n_heads} "
        f"head{'s' if args.n_heads != 1 else ''}, SwiGLU {args.ffn_hidden}, "
        f"vocabulary {args.vocab_size} (byte-level BPE), context {args.max_seq_len}, RoPE theta {args.rope_theta}.",
        "Trained on one document per row, each ending with `<|endoftext|>`, with no BOS: "
        "the tokenizer adds no special tokens.", "",
    ]
    if not metrics:  # metrics.json is the run's last write: without it, this is a checkpoint of a run under way or stopped
        lines += ["**An intermediate checkpoint:** the run had not finished when this was exported (it has no "
                  "`metrics.json`), so there are no held-out metrics.", ""]
    if metrics:
        lines += ["## Metrics (held-out split of the same dataset version)", ""]
        for key in ("steps", "final_loss_mean10", "val_loss", "val_accuracy", "train_tokens", "skipped_steps"):
            if metrics.get(key) is not None:
                value = metrics[key]
                lines.append(f"- {key}: {value:.4f}" if isinstance(value, float) else f"- {key}: {value}")
        lines.append("")
    trained_by = metrics.get("installations") if metrics else None
    if isinstance(trained_by, list) and trained_by:  # assay.installation; runs before it recorded none
        lines += ["## Software", ""]
        for i, part in enumerate(trained_by):
            until = trained_by[i + 1]["from_step"] if i + 1 < len(trained_by) else trainer["step"]
            steps = f"Steps {part['from_step']}-{until}: " if len(trained_by) > 1 else ""
            text = _software(part.get("installation"))
            lines.append(f"- {steps}{text}" if steps else f"- {text[0].upper()}{text[1:]}")
        lines.append("")
    lines += ["## Load", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "model = AutoModelForCausalLM.from_pretrained(PATH)", "tokenizer = AutoTokenizer.from_pretrained(PATH)",
              "```", ""]
    return "\n".join(lines)
