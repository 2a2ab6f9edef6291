"""`assay export`: a trained run becomes a transformers LlamaForCausalLM with the same logits and tokens."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from assay.config import TrainModelParams, TrainParams
from assay.errors import AssayError
from assay.versions import open_version
from corpus import stdlib_documents, write_documents
from training.export import export_run, interleaved_to_half, load_run_model
from training.model import apply_rope, rope_tables
from training.tokenizer import load_tokenizer
from training.trainer import train

BIN = Path(sys.executable).parent
ASSAY = shutil.which("assay", path=str(BIN)) or "assay"


def _params(steps: int = 8, **model) -> TrainParams:
    spec = dict(dim=32, n_layers=2, n_heads=4, ffn_hidden=64, **model)
    return TrainParams(model=TrainModelParams(**spec), vocab_size=320, seq_len=32, batch_size=4, steps=steps,
                       lr=1e-2, warmup_steps=2, checkpoint_every=steps, holdout=0.25, eval_rows=16, device="cpu")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("export")
    data = write_documents(tmp / "data", stdlib_documents(8), source="stdlib")
    train(open_version(data), tmp / "run", _params(), progress=False)
    return tmp / "run"


def test_the_permutation_turns_interleaved_rope_into_rotate_half():
    torch.manual_seed(0)
    heads, head_dim, dim, n = 3, 8, 12, 5
    w, x = torch.randn(heads * head_dim, dim), torch.randn(1, n, dim)
    cos, sin = rope_tables(head_dim, n, 10000.0)
    ours = apply_rope((x @ w.T).view(1, n, heads, head_dim), cos, sin)
    q = (x @ interleaved_to_half(w, heads).T).view(1, n, heads, head_dim)
    c, s = torch.cat([cos, cos], -1)[None, :, None], torch.cat([sin, sin], -1)[None, :, None]
    half = torch.cat([-q[..., head_dim // 2:], q[..., :head_dim // 2]], -1)
    theirs = q * c + half * s
    # The same rotation, with each head's features in rotate-half order: scores q·k are unchanged.
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    torch.testing.assert_close(theirs, ours[..., order], rtol=0, atol=1e-5)


def test_export_loads_in_transformers_with_the_same_logits_and_tokens(run_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    result = export_run(run_dir, out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(result["files"])

    hf = AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "LlamaForCausalLM"
    hf_tok = AutoTokenizer.from_pretrained(out)
    ours_tok = load_tokenizer(run_dir)
    text = "def parse(line):\n    return line.split(':')  # naïve, 2 fields — ok\n"
    ids = ours_tok.encode(text).ids
    assert hf_tok(text)["input_ids"] == ids
    assert hf_tok.decode(ids) == text
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.pad_token == "<|pad|>"
    assert hf.config.eos_token_id == ours_tok.token_to_id("<|endoftext|>") == hf_tok.eos_token_id
    assert hf.config.pad_token_id == hf_tok.pad_token_id

    model, _ = load_run_model(run_dir)
    tokens = torch.tensor([ids[:32], ids[-32:]])
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-5, diff  # measured 4.8e-7; without the q/k permutation 1.2e-2
    assert ours.abs().max() > 1  # trained logits, not a degenerate zero model

    metrics = json.loads((run_dir / "metrics.json").read_text())
    card = (out / "README.md").read_text()
    assert metrics["data"]["data_hash"] in card and f"step {metrics['steps']}" in card
    made_by = metrics["installation"]  # assay.installation, recorded by the trainer
    assert made_by["packages"]["torch"] == torch.__version__
    assert f"Trained with Assay {made_by['assay']} (source digest `{made_by['code']}`) on Python " \
           f"{made_by['python']}, torch {torch.__version__}, tokenizers " in card
    config = json.loads((out / "config.json").read_text())
    assert config["assay"]["data"]["data_hash"] == metrics["data"]["data_hash"]
    # The class name transformers 4.x resolves too (5.x calls it TokenizersBackend).
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_export_refuses_what_transformers_cannot_compute(tmp_path):
    data = write_documents(tmp_path / "data", stdlib_documents(4), source="stdlib")
    train(open_version(data), tmp_path / "moe", _params(steps=2, ffn="moe", n_experts=2, moe_topk=1), progress=False)
    with pytest.raises(AssayError, match="MoE cannot be exported"):
        export_run(tmp_path / "moe", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(AssayError, match="no finished checkpoint"):
        export_run(tmp_path / "data", tmp_path / "out")


def test_export_cli_and_sparse_refusal(run_dir, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run([ASSAY, "export", str(run_dir), "--out", str(out), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["step"] == 8
    with pytest.raises(AssayError, match="not empty"):
        export_run(run_dir, out)
    assert export_run(run_dir, out, overwrite=True)["step"] == 8  # an earlier export is replaced


def test_an_unfinished_run_exports_as_an_intermediate_checkpoint_and_says_so(run_dir, tmp_path):
    """A stopped run exported with no word that it had not finished (a probe, 2026-12-07)."""
    unfinished = shutil.copytree(run_dir, tmp_path / "unfinished")
    (unfinished / "metrics.json").unlink()  # the run's last write: as a run stopped before its end
    proc = subprocess.run([ASSAY, "export", str(unfinished), "--out", str(tmp_path / "e")], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert "has not finished (no metrics.json): this is an intermediate checkpoint" in proc.stderr
    card = (tmp_path / "e" / "README.md").read_text()
    assert "**An intermediate checkpoint:** the run had not finished" in card and "## Metrics" not in card
    export_run(run_dir, tmp_path / "finished")
    assert "intermediate checkpoint" not in (tmp_path / "finished" / "README.md").read_text()


def test_export_never_deletes_the_run_or_a_folder_that_is_not_an_export(run_dir, tmp_path):
    """--overwrite removed --out whole: with --out the run itself, or a folder holding it, the run was
    deleted (checkpoints and telemetry); with any other folder (`--out .`), that folder."""
    run = shutil.copytree(run_dir, tmp_path / "runs" / "round-0")
    (tmp_path / "runs" / "notes.txt").write_text("precious\n")
    for out, says in ((run, "is or holds the run"), (tmp_path / "runs", "is or holds the run"),
                      (tmp_path, "is or holds the run")):
        with pytest.raises(AssayError, match=says):
            export_run(run, out, overwrite=True)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious\n")
    with pytest.raises(AssayError, match="other than an Assay export"):
        export_run(run, mine, overwrite=True)
    (tmp_path / "afile").write_text("x\n")
    with pytest.raises(AssayError, match="is a file"):
        export_run(run, tmp_path / "afile", overwrite=True)
    assert (run / "checkpoints").is_dir() and (mine / "thesis.tex").is_file()
    assert (tmp_path / "runs" / "notes.txt").read_text() == "precious\n"

    sparse = tmp_path / "sparse"
    shutil.copytree(run_dir, sparse)
    state_file = next((sparse / "checkpoints").glob("step-*")) / "trainer.json"
    state = json.loads(state_file.read_text())
    state["model_args"]["attention"] = "sparse"
    state_file.write_text(json.dumps(state))
    with pytest.raises(AssayError, match="sparse attention cannot be exported"):
        export_run(sparse, tmp_path / "sparse-out")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_export_through_a_symlinked_out_writes_where_it_points_and_keeps_the_link(run_dir, tmp_path):
    """A symlinked --out was an internal error (rmtree refuses a link), and a dangling one a FileExistsError."""
    export_run(run_dir, tmp_path / "exp1")
    (tmp_path / "explink").symlink_to("exp1")
    assert export_run(run_dir, tmp_path / "explink", overwrite=True)["step"] == 8
    assert (tmp_path / "explink").is_symlink() and (tmp_path / "exp1" / "config.json").is_file()
    (tmp_path / "emptyd").mkdir()
    (tmp_path / "elink").symlink_to(tmp_path / "emptyd")
    export_run(run_dir, tmp_path / "elink")
    assert (tmp_path / "elink").is_symlink() and (tmp_path / "emptyd" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elink", "emptyd", "exp1", "explink"]  # no staging left

    (tmp_path / "dangling").symlink_to("nowhere")
    with pytest.raises(AssayError, match="dangling: is a symbolic link to nothing \\(nowhere\\)"):
        export_run(run_dir, tmp_path / "dangling")
    assert (tmp_path / "dangling").is_symlink() and not (tmp_path / "nowhere").exists()


def test_export_refuses_the_current_directory_before_deleting_anything(run_dir, tmp_path, monkeypatch):
    """`cd exp1copy; assay export RUN --out . --overwrite` deleted the earlier export, then failed with
    an internal OSError (rename of '.'); `--out ..` would have deleted the folder holding the cwd."""
    export_run(run_dir, tmp_path / "exp1")
    copy = shutil.copytree(tmp_path / "exp1", tmp_path / "exp1copy", symlinks=True)
    before = _files(copy)
    monkeypatch.chdir(copy)
    for out in (".", "..", str(copy)):
        with pytest.raises(AssayError, match="is or holds the current directory"):
            export_run(run_dir, out, overwrite=True)
    assert _files(copy) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run([ASSAY, "export", str(run_dir), "--out", "."], capture_output=True, text=True, cwd=empty)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "assay: error: .: is or holds the current directory, which the export would replace; choose another "
        "--out, such as a new folder's name"], proc.stderr
    assert list(empty.iterdir()) == []


def test_the_earlier_export_stays_whole_until_the_new_one_is_written(run_dir, tmp_path, monkeypatch):
    """--overwrite deleted the earlier export before writing: a failure (or a kill) mid-write left none."""
    import training.export

    out = tmp_path / "exp"
    export_run(run_dir, out)
    before = _files(out)

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(training.export, "model_card", fail)  # after the weights are written
    with pytest.raises(OSError, match="No space left"):
        export_run(run_dir, out, overwrite=True)
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # the failed write's staging is removed
    monkeypatch.undo()

    # A killed export's staging folder is cleared by the next one, which replaces the export whole.
    (tmp_path / ".exp.staging" / "export").mkdir(parents=True)
    (tmp_path / ".exp.staging" / "export" / "model.safetensors").write_bytes(b"half")
    (out / "stale.txt").write_text("from the earlier export\n")
    export_run(run_dir, out, overwrite=True)
    assert not (out / "stale.txt").exists() and _files(out)["model.safetensors"] == before["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]
