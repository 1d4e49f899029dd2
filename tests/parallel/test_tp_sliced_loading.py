"""Each rank reads only its slice of a sharded tensor from the safetensors files (rank 0, the
pytest process, is measured), and the tokens still equal one process's."""

from __future__ import annotations

from collections import defaultdict

from safetensors import safe_open

from deepserve.loader import checkpoint
from tests.parallel.conftest import greedy_tokens

SHARDED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head")


class _CountingSlice:
    def __init__(self, inner, name: str, reads: dict[str, int]) -> None:
        self.inner, self.name, self.reads = inner, name, reads

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, key):
        out = self.inner[key]
        self.reads[self.name] += out.numel() * out.element_size()
        return out


class _CountingFile:
    def __init__(self, path: str, reads: dict[str, int], **kwargs) -> None:
        self.inner, self.reads = safe_open(path, **kwargs), reads

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name: str):
        return _CountingSlice(self.inner.get_slice(name), name, self.reads)

    def get_tensor(self, name: str):
        out = self.inner.get_tensor(name)
        self.reads[name] += out.numel() * out.element_size()
        return out


def _sizes(path: str) -> dict[str, int]:
    sizes = {}
    for file in checkpoint.checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                t = f.get_tensor(name)
                sizes[name] = t.numel() * t.element_size()
    return sizes


def test_rank0_reads_half_of_each_sharded_tensor(llama_path, monkeypatch):
    reads: dict[str, int] = defaultdict(int)
    monkeypatch.setattr(checkpoint, "safe_open", lambda path, **kw: _CountingFile(path, reads, **kw))
    tp2 = greedy_tokens(llama_path, 2)
    monkeypatch.undo()
    sizes = _sizes(llama_path)
    assert set(reads) == set(sizes)
    for name, full in sizes.items():
        if any(f".{s}." in name or name.startswith(f"{s}.") or f"{s}.weight" in name for s in SHARDED):
            assert reads[name] == full // 2, (name, reads[name], full)  # each slice read once, never whole
        else:
            assert reads[name] == full, name  # norms are replicated: read whole, once
    assert sum(reads.values()) < 0.6 * sum(sizes.values())
    assert tp2 == greedy_tokens(llama_path, 1)
