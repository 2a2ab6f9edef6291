"""`assay domain train`: a small GPT-2-architecture LM on reference code.

The reference set is hand-written code: by default the corpus's standard
library Python modules (`domain.train.reference_sources`) that pass tier 3's
rules and parse. The model learns what ordinary code looks like, so generated
tables, encoded blobs and machine output score a high perplexity.

Saved with `save_pretrained` (safetensors), with its byte-level BPE tokenizer
(Hugging Face `tokenizers`) and `assay_domain_model.json`: the languages it
knows (the stage screens only those) and its held-out perplexities.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from assay.config import Params
from assay.devices import fast_bf16, pick_device
from assay.domain.perplexity import REPORT, sequence_perplexity
from assay.errors import AssayError
from assay.installation import installation
from assay.schema import KIND_CODE
from assay.shards import atomic_write_json, iter_batches, require_dataset

EOS = "<|endoftext|>"


def reference_code(data: str | Path, params: Params) -> list[str]:
    """Reference documents: the configured sources and languages, passing the rules and parsing."""
    from filters.code_rules import CodeRulesFilter
    from filters.code_syntax import SyntaxFilter

    require_dataset(data)
    train = params.domain.train
    rules, syntax = CodeRulesFilter(params.domain.rules), SyntaxFilter(params.domain)
    sources = pa.array(train.reference_sources, pa.string())
    langs = pa.array(train.reference_langs, pa.string())
    texts: list[str] = []
    for batch in iter_batches(data, columns=["id", "text", "kind", "lang", "source", "path"]):
        mask = pc.and_(pc.equal(batch.column("kind"), KIND_CODE),
                       pc.and_(pc.is_in(batch.column("source"), value_set=sources),
                               pc.is_in(batch.column("lang"), value_set=langs)))
        batch = batch.filter(mask)
        if batch.num_rows == 0:
            continue
        keep = rules.apply(batch).keep & syntax.apply(batch).keep
        texts.extend(batch.filter(pa.array(keep)).column("text").to_pylist())
    if len(texts) < 4:
        raise AssayError(
            f"{data}: only {len(texts)} reference code files (sources {train.reference_sources}, "
            f"languages {train.reference_langs}) pass the rules; set domain.train.reference_sources"
        )
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                   unk_token=EOS)


def _lr(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train_domain_model(data: str | Path, out: str | Path, params: Params,
                       progress: Callable[[int, float], None] | None = None) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    started = time.perf_counter()
    cfg = params.domain.train
    texts = reference_code(data, params)
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(texts))
    n_held = max(2, int(round(len(texts) * cfg.holdout)))
    held, train = [texts[i] for i in order[:n_held]], [texts[i] for i in order[n_held:]]

    tokenizer = train_tokenizer(train, cfg.vocab_size)
    stream = np.fromiter(
        (t for ids in tokenizer(train)["input_ids"] for t in (*ids, tokenizer.eos_token_id)), dtype=np.int64
    )
    if len(stream) <= cfg.context + 1:
        raise AssayError(f"{data}: reference code too small to train on ({len(stream)} tokens)")

    torch.manual_seed(cfg.seed)
    device = pick_device(params.domain.model.device)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=cfg.context, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                        n_head=cfg.n_head, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.eos_token_id)
    model = GPT2LMHeadModel(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95))
    bf16 = fast_bf16(device)
    window = cfg.context
    losses = []
    model.train()
    for step in range(cfg.steps):
        starts = rng.integers(0, len(stream) - window - 1, size=cfg.batch_size)
        batch = torch.from_numpy(np.stack([stream[s : s + window] for s in starts])).to(device)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, cfg.steps, cfg.lr)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if progress:
            progress(step, losses[-1])
    model.eval()

    held_ppl = []
    with torch.inference_mode():
        for text in held:
            ids = tokenizer(text[: window * 16], truncation=True, max_length=window, return_tensors="pt")
            if ids["input_ids"].shape[1] > 1:
                held_ppl.append(float(sequence_perplexity(model, ids["input_ids"].to(device),
                                                          ids["attention_mask"].to(device))[0]))
    report = {
        "architecture": "gpt2",
        "languages": sorted(set(cfg.reference_langs)),
        "reference": {"sources": cfg.reference_sources, "train_files": len(train), "heldout_files": len(held),
                      "train_tokens": int(len(stream))},
        "config": {k: getattr(cfg, k) for k in ("vocab_size", "n_layer", "n_head", "n_embd", "context", "steps",
                                                "batch_size", "lr", "seed")},
        "parameters": sum(p.numel() for p in model.parameters()),
        "loss_first": float(np.mean(losses[:10])),
        "loss_last": float(np.mean(losses[-10:])),
        "heldout_perplexities": held_ppl,
        "heldout_perplexity_median": float(np.median(held_ppl)) if held_ppl else None,
        "bf16": bf16,
        "seconds": round(time.perf_counter() - started, 2),
        "trained_at": datetime.now(timezone.utc).isoformat(),
        "installation": installation(),  # what trained it: domain's perplexity verdicts rest on it
    }
    # Written beside, then renamed: a killed run leaves no half-saved model. A symbolic link is
    # saved through, where it points (the link itself stays), as a folder's other writers do.
    out = Path(os.path.realpath(out))
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    atomic_write_json(tmp / REPORT, report)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {**report, "out": str(out)}


def report_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
