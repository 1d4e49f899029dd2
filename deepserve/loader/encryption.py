"""Weights encrypted at rest: `deepserve encrypt-model` writes them, the loader decrypts them in memory.

An encrypted shard `NAME.safetensors.enc` is the plaintext safetensors file cut into chunks of
`chunk_size` bytes, each sealed with an AEAD cipher (AES-256-GCM, or SM4-GCM for deployments that must use
the Chinese national standard), behind a short plaintext header:

    b"DSENC1\\0\\0" | u32 little-endian header length | header JSON | chunk 0 | chunk 1 | ...

The header names the cipher, the chunk size, the plaintext size, a random per-file nonce prefix and a key
id. Chunk i is `ciphertext || 16-byte tag`; its nonce is the prefix followed by i (so no nonce repeats
under one key), and its associated data binds the header (the file's base name included), i and whether it
is the last chunk, so a reordered, truncated, renamed or edited file fails authentication instead of loading.
Only the base name is bound: a shard moved to another subfolder under its name loads, which substitutes no
weight (tensor names are inside the sealed data, and every parameter must load).
Chunks make the file random-access: a rank reads and decrypts only the chunks that hold the tensor rows
it keeps (tensor parallelism: a slice along the first dimension is contiguous; a slice along a later
dimension spans whole rows, so that tensor is decrypted whole). Nothing decrypted is written to disk.

Key file: 32 random bytes as 64 hex characters (`deepserve encrypt-model --new-key-file K`). The cipher
keys are derived from it with HKDF-SHA256 (one per cipher), and so is the key id, which lets a wrong key
be named as such before any chunk is tried.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from deepserve.errors import ConfigRefused, FilesMissing

MAGIC = b"DSENC1\0\0"
SUFFIX = ".enc"
CIPHERS = ("aes-256-gcm", "sm4-gcm")
TAG_BYTES = 16
DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: a norm weight costs one chunk's decryption, a matrix many
CACHED_CHUNKS = 8  # neighbouring small tensors share chunks: keep the last few decrypted
# Files `encrypt-model` copies as they are: the loader and the tokenizer read them with no key.
PLAINTEXT_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".py", ".md", ".tiktoken")


class DecryptionError(ConfigRefused):
    """A wrong key, a tampered or truncated file, or an encrypted checkpoint loaded without its key."""


# --- keys -----------------------------------------------------------------------------------------------

def new_key_file(path: str | os.PathLike) -> None:
    """Writes a fresh 32-byte key as 64 hex characters, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")


def read_key_file(path: str | os.PathLike, flag: str = "--decryption-key-file") -> bytes:
    """The key in `path`; a file that is missing, unreadable or not a key is refused naming `flag` (user input:
    one line in the engine's log, no traceback)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError as exc:
        raise FilesMissing(f"{flag}: cannot read {path}: {exc.strerror}") from None
    except OSError as exc:  # a folder, no permission
        raise ConfigRefused(f"{flag}: cannot read {path}: {exc.strerror}") from None
    try:
        key = bytes.fromhex(data.decode("ascii").strip())
    except ValueError:  # not hex, or not text at all (raw key bytes): the message below says what is expected
        key = b""
    if len(key) != 32:
        raise ConfigRefused(f"{flag}: {path} must hold 32 bytes as 64 hex characters (deepserve encrypt-model "
                            "--new-key-file PATH writes one)")
    return key


def _derive(master: bytes, purpose: str, length: int) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(hashes.SHA256(), length, salt=None, info=f"deepserve-weights-v1/{purpose}".encode()).derive(master)


def key_id(master: bytes) -> str:
    return _derive(master, "key-id", 8).hex()


class _Aead:
    """Seal / open one chunk with the file's cipher."""

    def __init__(self, cipher: str, master: bytes) -> None:
        if cipher not in CIPHERS:
            raise ValueError(f"cipher {cipher!r} is not supported; use one of {', '.join(CIPHERS)}")
        self.cipher = cipher
        self.key = _derive(master, cipher, 32 if cipher == "aes-256-gcm" else 16)

    def seal(self, nonce: bytes, data: bytes, aad: bytes) -> bytes:
        if self.cipher == "aes-256-gcm":
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            return AESGCM(self.key).encrypt(nonce, data, aad)
        enc = self._sm4(nonce).encryptor()
        enc.authenticate_additional_data(aad)
        return enc.update(data) + enc.finalize() + enc.tag

    def open(self, nonce: bytes, sealed: bytes, aad: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        try:
            if self.cipher == "aes-256-gcm":
                from cryptography.hazmat.primitives.ciphers.aead import AESGCM

                return AESGCM(self.key).decrypt(nonce, sealed, aad)
            dec = self._sm4(nonce, sealed[-TAG_BYTES:]).decryptor()
            dec.authenticate_additional_data(aad)
            return dec.update(sealed[:-TAG_BYTES]) + dec.finalize()
        except InvalidTag:
            raise DecryptionError("authentication failed") from None

    def _sm4(self, nonce: bytes, tag: bytes | None = None):
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        return Cipher(algorithms.SM4(self.key), modes.GCM(nonce, tag))


def _nonce(prefix: bytes, index: int) -> bytes:
    return prefix + struct.pack(">I", index)


def _aad(header: bytes, index: int, last: bool) -> bytes:
    return header + struct.pack("<QB", index, last)


# --- writing --------------------------------------------------------------------------------------------

def encrypt_file(src: str | os.PathLike, dst: str | os.PathLike, master: bytes, cipher: str = "aes-256-gcm",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    size = os.path.getsize(src)
    num_chunks = max(1, -(-size // chunk_bytes))
    if num_chunks >= 2**32:
        raise ValueError(f"{src}: too many chunks; raise the chunk size")
    header = json.dumps({"cipher": cipher, "chunk_size": chunk_bytes, "plain_size": size,
                         "nonce_prefix": secrets.token_hex(8), "file": Path(dst).name, "key_id": key_id(master)},
                        sort_keys=True).encode()
    aead, prefix = _Aead(cipher, master), bytes.fromhex(json.loads(header)["nonce_prefix"])
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(MAGIC + struct.pack("<I", len(header)) + header)
        for i in range(num_chunks):
            fout.write(aead.seal(_nonce(prefix, i), fin.read(chunk_bytes), _aad(header, i, i == num_chunks - 1)))


def encrypt_model(src: str | os.PathLike, dst: str | os.PathLike, master: bytes,
                  cipher: str = "aes-256-gcm") -> list[str]:
    """The checkpoint folder src sealed into dst: each shard (_shards) as NAME.safetensors.enc, config,
    tokenizer and index files copied as they are (they hold no weights), all at their paths relative to src
    (subfolders kept: the copied index still names its shards). Returns the files written, relative to dst."""
    src, dst = Path(src), Path(dst)
    shards = _shards(src)
    if dst.resolve() == src.resolve():
        raise ValueError("encrypt-model: DST must be another folder than SRC (the plaintext stays in SRC)")
    written = []
    for shard in shards:
        (dst / shard).parent.mkdir(parents=True, exist_ok=True)
        encrypt_file(src / shard, dst / (shard + SUFFIX), master, cipher)
        written.append(shard + SUFFIX)
    for other in _plaintext_files(src, dst):
        (dst / other).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / other, dst / other)
        written.append(other.as_posix())
    return written


def _shards(src: Path) -> list[str]:
    """What the loader may read of src (checkpoint_files): the shards its index lists, checked to stay
    inside src, and every top-level *.safetensors (sealed as well when the index leaves one out, as before
    indexes were read, rather than dropped from the sealed copy). All checked to exist before anything is
    written, so a refusal leaves no half-sealed DST behind."""
    from deepserve.loader.checkpoint import INDEX, index_shards  # lazily: checkpoint.py imports this module

    listed = set(index_shards(str(src)) or [])  # normalized there: the loader reads the same list
    missing = sorted(n for n in listed if not (src / n).is_file())
    if missing:
        raise FilesMissing(f"{src / INDEX} lists shards that are not in {src}: {missing}")
    shards = sorted(listed | {p.name for p in src.glob("*.safetensors") if p.is_file()})
    if not shards:
        raise FilesMissing(f"no *.safetensors weights in {src}")
    return shards


def _plaintext_files(src: Path, dst: Path) -> list[Path]:
    """src's files ending in PLAINTEXT_SUFFIXES, subfolders included, relative to src. Hidden folders (.git,
    .cache: tools' state, not the checkpoint) are left out, and so is dst when it lies inside src (our own
    output, which would otherwise be copied into itself). Symlinked subfolders are followed, as the index's
    shards in them are (paths are checked by name, and Hugging Face cache snapshots are links), except a link
    back to a folder above it: that would loop forever."""
    found, skip = [], dst.resolve()
    above = {str(src): {os.path.realpath(src)}}  # each folder walked -> the real paths of it and its parents
    for root, dirs, files in os.walk(src, followlinks=True):
        kept = []
        for d in sorted(dirs):
            real = os.path.realpath(os.path.join(root, d))
            if not d.startswith(".") and Path(real) != skip and real not in above[root]:
                kept.append(d)
                above[os.path.join(root, d)] = above[root] | {real}
        dirs[:] = kept
        found += [Path(root, f).relative_to(src) for f in sorted(files)
                  if f.endswith(PLAINTEXT_SUFFIXES) and Path(root, f).is_file()]
    return found


# --- reading --------------------------------------------------------------------------------------------

class EncryptedFile:
    """Random-access plaintext of one sealed file: `read(offset, length)` decrypts only the chunks that
    range touches (the last CACHED_CHUNKS kept)."""

    def __init__(self, path: str | os.PathLike, master: bytes) -> None:
        self.path = str(path)
        with open(self.path, "rb") as f:
            lead = f.read(len(MAGIC) + 4)
            if len(lead) < len(MAGIC) + 4 or lead[:len(MAGIC)] != MAGIC:
                raise DecryptionError(f"{self.path} is not a deepserve encrypted file")
            self._header = f.read(struct.unpack("<I", lead[len(MAGIC):])[0])
        meta = json.loads(self._header)
        if meta["key_id"] != key_id(master):
            raise DecryptionError(f"{self.path} was encrypted with another key than --decryption-key-file's")
        if meta["file"] != Path(self.path).name:
            raise DecryptionError(f"{self.path} was encrypted as {meta['file']!r}: shards must keep their names")
        self._aead = _Aead(meta["cipher"], master)
        self._prefix = bytes.fromhex(meta["nonce_prefix"])
        self.chunk_bytes, self.size = meta["chunk_size"], meta["plain_size"]
        self._num_chunks = max(1, -(-self.size // self.chunk_bytes))
        self._data_start = len(MAGIC) + 4 + len(self._header)
        expected = self._data_start + self.size + self._num_chunks * TAG_BYTES
        if os.path.getsize(self.path) != expected:
            raise DecryptionError(f"{self.path} is {os.path.getsize(self.path)} bytes, its header says "
                                  f"{expected}: truncated or tampered")
        self._fd = os.open(self.path, os.O_RDONLY)
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self.chunks_decrypted = 0  # tests read it: a rank's slice must not decrypt the whole file

    def read(self, offset: int, length: int) -> bytearray:
        if offset < 0 or length < 0 or offset + length > self.size:
            # Not a refusal of the file: its size was checked when it was opened, and EncryptedSafetensors
            # checks every tensor's bytes lie inside it; a read past the end is our own offset arithmetic.
            raise RuntimeError(f"{self.path}: read of {length} bytes at offset {offset} is outside the plaintext's "
                               f"{self.size} bytes (a bug in deepserve's encrypted-shard reader)")
        if length == 0:
            # No chunk to open: at the end of a plaintext that fills its chunks (an empty last tensor), the
            # chunk the offset falls in does not exist, and opening it would fail authentication.
            return bytearray()
        out = bytearray(length)
        first, last = offset // self.chunk_bytes, (offset + length - 1) // self.chunk_bytes
        for i in range(first, last + 1):
            chunk, start = self._chunk(i), i * self.chunk_bytes
            lo, hi = max(offset, start), min(offset + length, start + len(chunk))
            out[lo - offset:hi - offset] = chunk[lo - start:hi - start]
        return out

    def _chunk(self, i: int) -> bytes:
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        plain = min(self.chunk_bytes, self.size - i * self.chunk_bytes)
        sealed = os.pread(self._fd, plain + TAG_BYTES, self._data_start + i * (self.chunk_bytes + TAG_BYTES))
        try:
            chunk = self._aead.open(_nonce(self._prefix, i), sealed, _aad(self._header, i, i == self._num_chunks - 1))
        except DecryptionError:
            raise DecryptionError(f"{self.path}: chunk {i} failed authentication (the file was modified, or "
                                  "the key is not the one it was encrypted with)") from None
        self.chunks_decrypted += 1
        self._cache[i] = chunk
        if len(self._cache) > CACHED_CHUNKS:
            self._cache.popitem(last=False)
        return chunk

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


# safetensors' dtype names -> torch (checkpoint.py reads plaintext shards with it too)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass
class EncryptedSlice:
    """One tensor of an encrypted shard, with the interface the loader uses of safetensors' slices:
    get_shape(), get_dtype() and `slice[a:b, c:d]` (reads and decrypts only the rows it needs)."""

    file: EncryptedFile
    dtype_name: str
    shape: tuple[int, ...]
    begin: int  # plaintext offset of the tensor's first byte

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype_name

    def __getitem__(self, window: tuple[slice, ...] | slice) -> torch.Tensor:
        window = window if isinstance(window, tuple) else (window,)
        dtype = SAFETENSORS_DTYPES.get(self.dtype_name)
        if dtype is None:
            raise ValueError(f"{self.file.path}: tensor dtype {self.dtype_name} is not supported")
        if not self.shape:
            return self._rows(dtype, 0, 1).reshape(())
        start, stop, _ = (window[0] if window else slice(None)).indices(self.shape[0])
        rows = self._rows(dtype, start, max(stop, start))  # whole rows of the first dimension
        return rows[(slice(None), *window[1:])].clone() if len(window) > 1 else rows

    def _rows(self, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
        row = int(torch.Size(self.shape[1:]).numel()) * dtype.itemsize
        data = self.file.read(self.begin + start * row, (stop - start) * row)
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(stop - start, *self.shape[1:])


class EncryptedSafetensors:
    """An encrypted shard read like safetensors' safe_open: keys() and get_slice(name)."""

    def __init__(self, path: str | os.PathLike, master: bytes) -> None:
        self.file = EncryptedFile(path, master)
        (length,) = struct.unpack("<Q", self.file.read(0, 8))
        if length > self.file.size - 8:
            raise DecryptionError(f"{path}: not a safetensors file inside")
        header = json.loads(bytes(self.file.read(8, length)))
        header.pop("__metadata__", None)
        self._data_start = 8 + length
        self._tensors = header
        # encrypt-model seals any *.safetensors as it is: one cut short before it was sealed (an interrupted
        # download) is refused here, rather than read past its end later.
        bad = [name for name, info in header.items() if not _fits(info, self.file.size - self._data_start)]
        if bad:
            raise DecryptionError(f"{path}: tensors {bad[:3]} lie outside the shard's data: the safetensors file "
                                  "was not whole when it was sealed; seal a complete copy again")

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_slice(self, name: str) -> EncryptedSlice:
        info = self._tensors[name]
        return EncryptedSlice(self.file, info["dtype"], tuple(info["shape"]),
                              self._data_start + info["data_offsets"][0])


def _fits(info: dict, room: int) -> bool:
    """Whether a safetensors header entry puts the tensor's bytes inside the data section (`room` bytes), as many
    as its shape and dtype need: then no read of it goes past the plaintext."""
    try:
        begin, end = info["data_offsets"]
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        need = math.prod(info["shape"]) * dtype.itemsize if dtype is not None else end - begin  # exotic: read as is
        return 0 <= begin <= end <= room and end - begin == need
    except (KeyError, TypeError, ValueError):  # not an entry of a safetensors header
        return False
