"""Weights encrypted at rest: the sealed format, its refusals, and a checkpoint served from it.

The reference for every read is the plaintext: bytes of the source file, safetensors' own safe_open, and
transformers' greedy output of the model the checkpoint came from."""

from __future__ import annotations

import json
import os
import re
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepserve.errors import ConfigRefused, FilesMissing
from deepserve.loader import encryption as enc

pytest.importorskip("cryptography")
CIPHERS = list(enc.CIPHERS)


@pytest.fixture
def key():
    return bytes(range(32))


def _seal(tmp_path, data: bytes, key: bytes, cipher: str, chunk: int):
    src, dst = tmp_path / "x.bin", tmp_path / "x.bin.enc"
    src.write_bytes(data)
    enc.encrypt_file(src, dst, key, cipher, chunk_bytes=chunk)
    return dst


@pytest.mark.parametrize("cipher", CIPHERS)
def test_random_reads_equal_the_plaintext_and_touch_only_their_chunks(tmp_path, key, cipher):
    data = os.urandom(1000)
    f = enc.EncryptedFile(_seal(tmp_path, data, key, cipher, chunk=64), key)
    assert f.size == 1000
    for offset, length in [(0, 1000), (63, 2), (999, 1), (128, 64), (500, 0), (10, 300)]:
        assert bytes(f.read(offset, length)) == data[offset:offset + length]
    fresh = enc.EncryptedFile(tmp_path / "x.bin.enc", key)
    fresh.read(130, 10)  # inside chunk 2 only
    assert fresh.chunks_decrypted == 1
    assert b"".join(data[i:i + 16] for i in range(0, 64, 16)) not in (tmp_path / "x.bin.enc").read_bytes()
    with pytest.raises(RuntimeError, match="outside the plaintext's 1000 bytes") as caught:
        f.read(990, 20)
    assert not isinstance(caught.value, ValueError)  # our own bug: not a refusal, so it keeps its traceback


@pytest.mark.parametrize("cipher", CIPHERS)
def test_tampering_truncation_reordering_renaming_and_wrong_keys_are_refused(tmp_path, key, cipher):
    path = _seal(tmp_path, os.urandom(640), key, cipher, chunk=64)
    sealed = bytearray(path.read_bytes())
    header_end = len(sealed) - 10 * (64 + enc.TAG_BYTES)

    def sealed_copy(folder: str, data: bytes, name: str = "x.bin.enc"):  # under the name it was sealed as
        (tmp_path / folder).mkdir()
        p = tmp_path / folder / name
        p.write_bytes(data)
        return p

    flipped = bytearray(sealed)
    flipped[header_end + 3 * 80 + 5] ^= 1  # a byte of chunk 3
    f = enc.EncryptedFile(sealed_copy("flip", flipped), key)
    f.read(0, 64 * 3)  # chunks 0-2 are intact
    with pytest.raises(enc.DecryptionError, match="chunk 3 failed authentication"):
        f.read(64 * 3, 1)
    swapped = sealed[:header_end] + sealed[header_end + 80:header_end + 160] + sealed[header_end:header_end + 80] \
        + sealed[header_end + 160:]
    with pytest.raises(enc.DecryptionError, match="chunk 0 failed"):
        enc.EncryptedFile(sealed_copy("swap", swapped), key).read(0, 1)
    with pytest.raises(enc.DecryptionError, match="truncated"):
        enc.EncryptedFile(sealed_copy("cut", sealed[:-80]), key)
    # The last chunk dropped and the header's size edited to match: the new last chunk was sealed as not last.
    edited = bytes(sealed[:-80]).replace(b'"plain_size": 640', b'"plain_size": 576')
    with pytest.raises(enc.DecryptionError, match="failed authentication"):
        enc.EncryptedFile(sealed_copy("edit", edited), key).read(570, 1)
    with pytest.raises(enc.DecryptionError, match="encrypted as 'x.bin.enc'"):
        enc.EncryptedFile(sealed_copy("renamed", sealed, "y.bin.enc"), key)
    with pytest.raises(enc.DecryptionError, match="another key"):
        enc.EncryptedFile(path, bytes(32))
    with pytest.raises(enc.DecryptionError, match="not a deepserve encrypted file"):
        enc.EncryptedFile(sealed_copy("plain", b"hello world, not sealed"), key)


def test_tensors_and_their_windows_read_as_safetensors_reads_them(tmp_path, key):
    torch.manual_seed(0)
    tensors = {
        "w.bf16": torch.randn(37, 19, dtype=torch.bfloat16),
        "w.f32": torch.randn(5, 3, 7),
        "w.fp8": torch.randn(33, 16).to(torch.float8_e4m3fn),
        "w.i32": torch.randint(-9, 9, (11,), dtype=torch.int32),
        "s.f32": torch.tensor(2.5),
    }
    src = tmp_path / "m.safetensors"
    save_file(tensors, src, metadata={"format": "pt"})
    enc.encrypt_file(src, tmp_path / "m.safetensors.enc", key, chunk_bytes=128)
    sealed = enc.EncryptedSafetensors(tmp_path / "m.safetensors.enc", key)
    with safe_open(src, framework="pt") as plain:
        assert sorted(sealed.keys()) == sorted(plain.keys())
        for name in plain.keys():  # noqa: SIM118
            ours, theirs = sealed.get_slice(name), plain.get_slice(name)
            assert ours.get_shape() == theirs.get_shape() and ours.get_dtype() == theirs.get_dtype()
            full = tuple(slice(0, n) for n in theirs.get_shape())
            got, want = ours[full], plain.get_tensor(name)
            assert got.shape == want.shape and got.dtype == want.dtype
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        assert torch.equal(sealed.get_slice("w.bf16")[3:9, 2:11], plain.get_slice("w.bf16")[3:9, 2:11])
        assert torch.equal(sealed.get_slice("w.f32")[1:4, :, 2:5], plain.get_slice("w.f32")[1:4, :, 2:5])


def test_a_first_dimension_slice_decrypts_only_its_rows(tmp_path, key):
    rows = torch.randn(64, 256)  # 1 KiB a row, 64 KiB in all: 64 chunks of 1 KiB
    save_file({"w": rows}, tmp_path / "m.safetensors")
    enc.encrypt_file(tmp_path / "m.safetensors", tmp_path / "m.safetensors.enc", key, chunk_bytes=1024)
    sealed = enc.EncryptedSafetensors(tmp_path / "m.safetensors.enc", key)
    before = sealed.file.chunks_decrypted
    half = sealed.get_slice("w")[32:48, 0:256]  # one rank's quarter under tensor parallelism
    assert torch.equal(half, rows[32:48])
    assert sealed.file.chunks_decrypted - before <= 17  # 16 rows of 1 KiB, offset by the header


def test_key_files(tmp_path):
    path = tmp_path / "k"
    enc.new_key_file(path)
    assert len(enc.read_key_file(path)) == 32 and oct(path.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(FileExistsError):
        enc.new_key_file(path)
    # Refusals naming the flag and the file (the engine logs them in one line): a missing file is still a
    # FileNotFoundError, a folder or a file that is no key a ValueError.
    (tmp_path / "short").write_text("abcd")
    (tmp_path / "raw").write_bytes(bytes(range(200, 232)))  # 32 bytes, but not as hex
    for name in ("short", "raw"):
        with pytest.raises(ConfigRefused, match=rf"--decryption-key-file: .*{name} must hold 32 bytes as 64 hex"):
            enc.read_key_file(tmp_path / name)
    with pytest.raises(FilesMissing, match=r"--key-file: cannot read .*missing: No such file") as caught:
        enc.read_key_file(tmp_path / "missing", "--key-file")
    assert isinstance(caught.value, FileNotFoundError)
    with pytest.raises(ConfigRefused, match=r"--decryption-key-file: cannot read .*: Is a directory"):
        enc.read_key_file(tmp_path)


def test_a_bad_key_file_is_refused_before_the_engine_loads(tmp_path):
    # Checked where the configuration is made, so the server's process refuses it at once (the engine process
    # reads it again to load); with dummy weights no key is read, as before.
    from transformers import LlamaConfig

    from deepserve.config import EngineArgs

    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=64).save_pretrained(tmp_path)
    args = EngineArgs(model=str(tmp_path), device="cpu", decryption_key_file=str(tmp_path / "missing"))
    with pytest.raises(FilesMissing, match=r"--decryption-key-file: cannot read .*missing"):
        args.create_engine_config()
    (tmp_path / "key").write_text("not a key")
    with pytest.raises(ConfigRefused, match="64 hex characters"):
        EngineArgs(model=str(tmp_path), device="cpu", decryption_key_file=str(tmp_path / "key")).create_engine_config()
    enc.new_key_file(tmp_path / "good")
    EngineArgs(model=str(tmp_path), device="cpu", decryption_key_file=str(tmp_path / "good")).create_engine_config()
    EngineArgs(model=str(tmp_path), device="cpu", load_format="dummy",
               decryption_key_file=str(tmp_path / "missing")).create_engine_config()


def test_a_shard_cut_short_before_it_was_sealed_is_refused_when_opened(tmp_path, key):
    # encrypt-model seals any *.safetensors as it is; its tensors must lie inside it, or reading one would go
    # past the plaintext's end (which EncryptedFile.read treats as a bug of ours).
    save_file({"a": torch.ones(64), "b": torch.ones(64)}, tmp_path / "m.safetensors")
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-100])
    enc.encrypt_file(tmp_path / "cut.safetensors", tmp_path / "cut.safetensors.enc", key)
    with pytest.raises(enc.DecryptionError) as refused:
        enc.EncryptedSafetensors(tmp_path / "cut.safetensors.enc", key)
    said = str(refused.value)  # one line naming the file and the tensor cut off ("a" is whole)
    assert "\n" not in said and str(tmp_path / "cut.safetensors.enc") in said and "['b']" in said, said
    enc.encrypt_file(tmp_path / "m.safetensors", tmp_path / "m.safetensors.enc", key)
    assert sorted(enc.EncryptedSafetensors(tmp_path / "m.safetensors.enc", key).keys()) == ["a", "b"]


def _save_of_exactly(path, size: int, last: torch.Tensor) -> None:
    """A safetensors file of `size` bytes, header included, whose data ends with `last` (its name sorts last;
    the random bytes of "a" before it fill the rest). Grown until the header's length settles."""
    filler = 0
    for _ in range(10):
        torch.manual_seed(0)
        save_file({"a": torch.randint(0, 256, (filler,), dtype=torch.uint8), "z": last}, path)
        if path.stat().st_size == size:
            return
        filler += size - path.stat().st_size
    raise AssertionError(f"no filler makes {path} {size} bytes")


def test_empty_and_scalar_tensors_read_as_the_plaintext_even_at_a_chunk_boundary(tmp_path, key):
    # A shard of exactly one chunk whose last tensor has no elements: reading it is a read of 0 bytes at the
    # plaintext's end, which once asked for a chunk past the last and was taken for a failed authentication.
    from deepserve.loader.checkpoint import iterate_safetensors, materialize

    plain = tmp_path / "plain"
    plain.mkdir()
    _save_of_exactly(plain / "model-00001.safetensors", enc.DEFAULT_CHUNK_BYTES, torch.zeros(0, dtype=torch.uint8))
    with safe_open(plain / "model-00001.safetensors", framework="pt") as f:  # the case meant: "z" ends the data
        assert f.get_slice("z").get_shape() == [0]
    data = (plain / "model-00001.safetensors").read_bytes()
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    assert json.loads(data[8:header_end])["z"]["data_offsets"] == [len(data) - header_end] * 2
    save_file({"scalar": torch.tensor(2.5), "no_rows": torch.zeros(0, 4), "no_columns": torch.zeros(3, 0),
               "shapeless_int": torch.tensor(7, dtype=torch.int32)}, plain / "model-00002.safetensors")
    enc.encrypt_model(plain, tmp_path / "sealed", key)

    want = {n: materialize(t) for n, t in iterate_safetensors(str(plain))}
    got = {n: materialize(t) for n, t in iterate_safetensors(str(tmp_path / "sealed"), key)}
    assert sorted(got) == sorted(want) == ["a", "no_columns", "no_rows", "scalar", "shapeless_int", "z"]
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape and got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def test_an_encrypted_checkpoint_serves_what_transformers_computes(tmp_path, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepserve import LLM, SamplingParams
    from deepserve.entrypoints.cli import main

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf_model = LlamaForCausalLM(config).eval()
    src, dst, key = tmp_path / "plain", tmp_path / "sealed", tmp_path / "key"
    hf_model.save_pretrained(src, max_shard_size="100KB")  # several shards and their index
    tokenizer.save_pretrained(src)
    assert main(["encrypt-model", str(src), str(dst), "--key-file", str(key), "--new-key-file"]) == 0
    names = os.listdir(dst)
    assert not any(n.endswith(".safetensors") for n in names)
    assert sum(n.endswith(".safetensors.enc") for n in names) > 1 and "model.safetensors.index.json" in names

    prompt = [5, 17, 300, 42, 9]
    with torch.no_grad():
        want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(dst), decryption_key_file=str(key), dtype="float32", device="cpu", num_gpu_blocks_override=32)
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want

    with pytest.raises(enc.DecryptionError, match="--decryption-key-file"):
        LLM(str(dst), dtype="float32", device="cpu", num_gpu_blocks_override=32)
    # The command line passes the key on (it once parsed the flag and dropped it).
    cli = ["generate", "--model", str(dst), "--dtype", "float32", "--device", "cpu", "--num-gpu-blocks-override", "32",
           "--max-tokens", "4", "hello"]
    assert main(cli + ["--decryption-key-file", str(key)]) == 0
    assert main(cli) == 2  # without it: "... is encrypted: pass its key with --decryption-key-file"
    other = tmp_path / "other-key"
    enc.new_key_file(other)
    with pytest.raises(enc.DecryptionError, match="another key"):
        LLM(str(dst), decryption_key_file=str(other), dtype="float32", device="cpu", num_gpu_blocks_override=32)


def test_encrypt_model_refuses_its_own_source_folder(tmp_path, key):
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="another folder"):
        enc.encrypt_model(tmp_path, tmp_path, key)
    assert struct.unpack("<Q", (tmp_path / "model.safetensors").read_bytes()[:8])[0] > 0  # untouched


def test_a_sealed_checkpoint_loads_only_whole_and_a_key_only_sealed_weights(tmp_path, key):
    # A plaintext shard beside sealed ones (a substituted or left-over file) would load unauthenticated:
    # refused, with and without an index; a key given for a plaintext checkpoint is refused too.
    from deepserve.loader.checkpoint import checkpoint_files, iterate_safetensors

    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"a": torch.ones(2)}, plain / "model-00001.safetensors")
    save_file({"b": torch.ones(2)}, plain / "model-00002.safetensors")
    with pytest.raises(enc.DecryptionError, match="is not encrypted"):
        next(iterate_safetensors(str(plain), key))
    assert len(list(iterate_safetensors(str(plain)))) == 2  # without a key: as before
    sealed = tmp_path / "sealed"
    enc.encrypt_model(plain, sealed, key)
    assert [os.path.basename(p) for p in checkpoint_files(str(sealed))] == [
        "model-00001.safetensors.enc", "model-00002.safetensors.enc"]
    save_file({"a": torch.zeros(2)}, sealed / "model-00001.safetensors")  # the substitute
    with pytest.raises(enc.DecryptionError, match=r"plaintext shards \['model-00001.safetensors'\]"):
        checkpoint_files(str(sealed))
    (sealed / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001.safetensors", "b": "model-00002.safetensors"}}')
    with pytest.raises(enc.DecryptionError, match="loads only whole"):
        checkpoint_files(str(sealed))
    os.remove(sealed / "model-00001.safetensors")
    os.remove(sealed / "model-00002.safetensors.enc")
    with pytest.raises(FileNotFoundError, match=r"lists shards .* plain or sealed: \['model-00002.safetensors'\]"):
        checkpoint_files(str(sealed))  # a shard the index lists is neither: said as missing, not as plaintext
    save_file({"b": torch.zeros(2)}, sealed / "model-00002.safetensors")  # one sealed, one plain: a mix
    with pytest.raises(enc.DecryptionError, match=r"plaintext shards \['model-00002.safetensors'\]"):
        checkpoint_files(str(sealed))


def _index(folder, weight_map: dict[str, str]) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_shards_in_subfolders_seal_and_load_as_the_plaintext(tmp_path):
    # An index may name shards in subfolders: encrypt-model seals them at the same relative paths (the copied
    # index still names them) and copies the subfolders' config files; both checkpoints load the same tensors.
    from deepserve.entrypoints.cli import main
    from deepserve.loader.checkpoint import checkpoint_files, iterate_safetensors, materialize

    plain, sealed, key_file = tmp_path / "plain", tmp_path / "sealed", tmp_path / "key"
    (plain / "sub" / "deeper").mkdir(parents=True)
    torch.manual_seed(1)
    save_file({"a": torch.randn(5, 3), "b": torch.randn(4)}, plain / "sub" / "model-00001-of-00003.safetensors")
    save_file({"c": torch.randn(2, 2, 2)}, plain / "sub" / "deeper" / "model-00002-of-00003.safetensors")
    save_file({"d": torch.randn(7, dtype=torch.float64)}, plain / "model-00003-of-00003.safetensors")
    _index(plain, {"a": "sub/model-00001-of-00003.safetensors", "b": "sub/model-00001-of-00003.safetensors",
                   "c": "sub/deeper/model-00002-of-00003.safetensors", "d": "model-00003-of-00003.safetensors"})
    (plain / "config.json").write_text("{}")
    (plain / "sub" / "config.json").write_text('{"sub": 1}')
    (plain / "sub" / "deeper" / "tokenizer.model").write_bytes(b"spm")
    (plain / "sub" / "notes.bin").write_bytes(b"not a config")
    (plain / ".cache").mkdir()
    (plain / ".cache" / "download.json").write_text("{}")  # a tool's state, not the checkpoint's

    want = {n: materialize(t) for n, t in iterate_safetensors(str(plain))}  # plaintext subfolder shards load
    assert sorted(want) == ["a", "b", "c", "d"]
    assert main(["encrypt-model", str(plain), str(sealed), "--key-file", str(key_file), "--new-key-file"]) == 0
    files = sorted(p.relative_to(sealed).as_posix() for p in sealed.rglob("*") if p.is_file())
    assert files == ["config.json", "model-00003-of-00003.safetensors.enc", "model.safetensors.index.json",
                     "sub/config.json", "sub/deeper/model-00002-of-00003.safetensors.enc", "sub/deeper/tokenizer.model",
                     "sub/model-00001-of-00003.safetensors.enc"]
    assert (sealed / "sub" / "config.json").read_text() == '{"sub": 1}'
    assert [os.path.relpath(p, sealed) for p in checkpoint_files(str(sealed))] == [
        "model-00003-of-00003.safetensors.enc", "sub/deeper/model-00002-of-00003.safetensors.enc",
        "sub/model-00001-of-00003.safetensors.enc"]
    got = {n: materialize(t) for n, t in iterate_safetensors(str(sealed), enc.read_key_file(key_file))}
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)


@pytest.mark.parametrize("entry", ["../x.safetensors", "sub/../../x.safetensors", "ABSOLUTE"])
def test_an_index_entry_outside_the_folder_is_refused_by_encrypt_model_and_the_loader(tmp_path, key, entry):
    # A crafted index must not make either read a file outside the checkpoint, though one is there to read.
    from deepserve.errors import ConfigRefused
    from deepserve.loader.checkpoint import checkpoint_files, iterate_safetensors

    entry = str(tmp_path / "x.safetensors") if entry == "ABSOLUTE" else entry
    plain, sealed = tmp_path / "plain", tmp_path / "sealed"
    plain.mkdir()
    save_file({"a": torch.ones(2)}, plain / "model-00001.safetensors")
    save_file({"b": torch.ones(2)}, tmp_path / "x.safetensors")
    _index(plain, {"a": "model-00001.safetensors", "b": entry})
    refusal = rf"model.safetensors.index.json lists shards outside .*plain: \[{re.escape(repr(entry))}\]"
    with pytest.raises(ConfigRefused, match=refusal):
        enc.encrypt_model(plain, sealed, key)
    assert not sealed.exists()  # refused before anything was written
    with pytest.raises(ConfigRefused, match=refusal):
        checkpoint_files(str(plain))
    with pytest.raises(ConfigRefused, match=refusal):
        next(iterate_safetensors(str(plain)))

    # A sealed checkpoint whose index is edited afterwards, with a sealed file waiting outside: refused too.
    _index(plain, {"a": "model-00001.safetensors"})
    enc.encrypt_model(plain, sealed, key)
    enc.encrypt_file(tmp_path / "x.safetensors", tmp_path / "x.safetensors.enc", key)
    _index(sealed, {"a": "model-00001.safetensors", "b": entry})
    with pytest.raises(ConfigRefused, match=refusal.replace("plain", "sealed")):
        next(iterate_safetensors(str(sealed), key))


def _json_error(text: str) -> str:
    try:
        json.loads(text)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{text!r} is valid JSON")


# What each refusal must name besides the index: the parser's complaint, the field missing, the bad values.
@pytest.mark.parametrize(("text", "named"), [
    ('{"weight_map": ', [_json_error('{"weight_map": ')]),
    ('{"metadata": {}}', ["weight_map"]),
    ('["m.safetensors"]', ["weight_map"]),
    ('{"weight_map": ["m.safetensors"]}', ["weight_map"]),
    ('{"weight_map": {"a": "m.safetensors", "b": 3, "c": null}}', ["'b': 3", "'c': None"]),
    ('{"weight_map": {"a": "m.safetensors", "b": ""}}', ["['']"]),
    ('{"weight_map": {"a": "m.safetensors", "b": "."}}', ["['.']"]),
    ('{"weight_map": {"a": "m.safetensors", "b": "sub/", "c": "sub/."}}', ["['sub/', 'sub/.']"]),
], ids=["json", "no-map", "list", "map-list", "non-string", "empty", "dot", "folder"])
def test_a_malformed_index_is_refused_naming_it_by_the_loader_and_encrypt_model(tmp_path, key, text, named):
    # Once a KeyError, a TypeError, or a JSON error that did not name the file: tracebacks from the engine.
    from deepserve.loader.checkpoint import checkpoint_files

    plain = tmp_path / "plain"
    (plain / "sub").mkdir(parents=True)
    save_file({"a": torch.ones(2)}, plain / "m.safetensors")
    (plain / "model.safetensors.index.json").write_text(text)
    for refuse in (lambda: checkpoint_files(str(plain)), lambda: enc.encrypt_model(plain, tmp_path / "sealed", key)):
        with pytest.raises(ConfigRefused) as refused:
            refuse()
        said = str(refused.value)
        assert said.startswith(str(plain / "model.safetensors.index.json")) and "\n" not in said, said
        assert all(fact in said for fact in named), said
    assert not (tmp_path / "sealed").exists()


def test_an_index_entry_naming_a_folder_is_a_missing_shard(tmp_path):
    # "sub" names a folder, not a shard: once taken for a plaintext shard and opened (a traceback).
    from deepserve.errors import FilesMissing
    from deepserve.loader.checkpoint import checkpoint_files

    plain = tmp_path / "plain"
    (plain / "sub").mkdir(parents=True)
    save_file({"a": torch.ones(2)}, plain / "m.safetensors")
    _index(plain, {"a": "m.safetensors", "b": "sub"})
    with pytest.raises(FilesMissing, match=r"lists shards that are not in .*plain or sealed: \['sub'\]"):
        checkpoint_files(str(plain))


def test_index_entries_that_name_one_file_are_one_shard(tmp_path, key):
    # "./m.safetensors", "m.safetensors" and "sub//n.safetensors" normalize to two files: the loader reads each
    # once (its tensors twice would be loaded twice) and encrypt-model seals the same two.
    from deepserve.loader.checkpoint import checkpoint_files, index_shards, iterate_safetensors

    plain = tmp_path / "plain"
    (plain / "sub").mkdir(parents=True)
    save_file({"a": torch.ones(2)}, plain / "m.safetensors")
    save_file({"b": torch.ones(3), "c": torch.ones(4)}, plain / "sub" / "n.safetensors")
    _index(plain, {"a": "./m.safetensors", "b": "sub//n.safetensors", "c": "sub/./n.safetensors"})
    assert index_shards(str(plain)) == ["m.safetensors", "sub/n.safetensors"]
    assert [os.path.relpath(p, plain) for p in checkpoint_files(str(plain))] == ["m.safetensors", "sub/n.safetensors"]
    assert [n for n, _ in iterate_safetensors(str(plain))] == ["a", "b", "c"]
    assert enc.encrypt_model(plain, tmp_path / "sealed", key)[:2] == ["m.safetensors.enc", "sub/n.safetensors.enc"]
    assert [n for n, _ in iterate_safetensors(str(tmp_path / "sealed"), key)] == ["a", "b", "c"]


def test_a_symlinked_subfolder_is_sealed_whole_and_a_link_loop_is_not_followed(tmp_path, key):
    # Hugging Face cache style: the index's shards in a linked subfolder were sealed (paths are checked by name)
    # but its config files were not copied. A link back up the tree must not make the walk loop.
    plain, elsewhere, sealed = tmp_path / "plain", tmp_path / "elsewhere", tmp_path / "sealed"
    (elsewhere / "deeper").mkdir(parents=True)
    plain.mkdir()
    save_file({"a": torch.ones(2)}, elsewhere / "n.safetensors")
    (elsewhere / "config.json").write_text('{"linked": 1}')
    (elsewhere / "deeper" / "tokenizer.json").write_text("{}")
    (plain / "sub").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / "deeper" / "up").symlink_to(plain, target_is_directory=True)  # plain/sub/deeper/up -> plain
    (elsewhere / "deeper" / "self").symlink_to(elsewhere / "deeper", target_is_directory=True)
    (plain / "config.json").write_text("{}")
    _index(plain, {"a": "sub/n.safetensors"})
    written = enc.encrypt_model(plain, sealed, key)
    assert sorted(written) == ["config.json", "model.safetensors.index.json", "sub/config.json",
                               "sub/deeper/tokenizer.json", "sub/n.safetensors.enc"]
    assert (sealed / "sub" / "config.json").read_text() == '{"linked": 1}'
